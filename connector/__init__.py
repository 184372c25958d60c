"""connector package."""
