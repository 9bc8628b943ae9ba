import sys

from radixflow.bench.cli import main

sys.exit(main())
