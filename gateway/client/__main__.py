"""`python -m gateway.client`: the `token2wav` command."""

import sys

from gateway.client.cli import main

sys.exit(main())
