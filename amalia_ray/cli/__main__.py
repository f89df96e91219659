import sys

from amalia_ray.cli import main

sys.exit(main())
