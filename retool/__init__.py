"""retool-rl: reinforcement learning for strategic code-interpreter use in math reasoning.

See the README for the commands and ``retool --help`` for the CLI.
"""

__version__ = "0.1.0"
