"""kvpush services: CLI, engine launcher, local stack, push scheduler and gateway."""
