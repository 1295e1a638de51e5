"""``python -m tfremat``: the ``tfremat`` command line (:mod:`tfremat.cli`), for environments
where the console script is not on ``PATH``."""

from tfremat.cli import run

if __name__ == "__main__":
    run()
