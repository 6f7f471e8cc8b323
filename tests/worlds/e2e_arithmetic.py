"""Run the arithmetic recipe's main with the given CLI args (torchrun entry for tests)."""

import tyro

from recipes.arithmetic import ArithmeticConfig, main

if __name__ == "__main__":
    main(tyro.cli(ArithmeticConfig))
