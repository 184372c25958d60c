"""``python -m kvpush.services.gateway``: the same server as ``kvpush gateway``."""

from kvpush.services.gateway.app import main

if __name__ == "__main__":
    main()
