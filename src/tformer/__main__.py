import sys

from tformer.cli.main import main

sys.exit(main())
