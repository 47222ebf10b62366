"""`python -m modelfs`: the `modelfs` command, for an environment whose scripts are not on PATH."""

from modelfs.cli import main

main()
