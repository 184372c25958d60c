"""The ``kvpush`` command: its entry point and the subcommands that administer a deployment
(tenants, Redis users, draining)."""
