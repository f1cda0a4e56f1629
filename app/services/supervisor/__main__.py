"""`python -m app.services.supervisor`: the command line every nnui job's supervisor runs with,
recorded by running jobs and recognised by signals/targets.py; kept across the layout move."""

import sys

from app.services.supervisor.main import main

if __name__ == "__main__":
    sys.exit(main())
