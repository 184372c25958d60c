"""Pieces every kvpush service shares: settings, Redis key names, wire types, logging, runtime."""
