"""`python -m strata.serve`: run the server with the same flags as `strata serve`."""

import sys

from strata.serve.main import main

sys.exit(main())
