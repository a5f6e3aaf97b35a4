"""Run the flashrt node: `python -m flashrt_ros [--ros-args ...]`."""

import sys

from flashrt_ros.node import main

if __name__ == '__main__':
    sys.exit(main())
