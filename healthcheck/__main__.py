import sys

from healthcheck.cli import main

if __name__ == "__main__":
    sys.exit(main())
