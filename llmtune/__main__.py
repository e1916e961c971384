import sys

from llmtune.cli import main

sys.exit(main())
