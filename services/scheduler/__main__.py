"""``python -m kvpush.services.scheduler``: the same process as ``kvpush scheduler``."""

from kvpush.services.scheduler.loop import main

if __name__ == "__main__":
    main()
