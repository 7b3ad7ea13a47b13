import sys

from sandboxfs.cli.main import main

sys.exit(main())
