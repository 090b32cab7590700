"`python -m minfer COMMAND ...`: the `minfer` command, every chapter loaded."
import sys

from minfer import main

sys.exit(main())
