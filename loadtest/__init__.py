"""Load tests and benchmarks of kvpush deployments."""
