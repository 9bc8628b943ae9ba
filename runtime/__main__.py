"""`python -m radixflow.runtime [serve] --model smollm2`: see `radixflow.runtime.cli`."""

import sys

from radixflow.runtime.cli import main

sys.exit(main())
