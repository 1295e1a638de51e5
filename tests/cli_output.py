"""What the command-line tool itself wrote to stderr, apart from TensorFlow's start-up lines.

TensorFlow and absl write their own lines at import (the absl pre-init warning, "oneDNN
custom operations are on" on CPUs where oneDNN is on by default), so counting stderr lines
depends on the machine; tests look for the tool's lines by their prefix instead.
"""


def tool_lines(stderr: str) -> list[str]:
    """The lines the tool wrote (they start with ``tfremat:``)."""
    return [line for line in stderr.splitlines() if line.startswith("tfremat:")]


def one_error_line(stderr: str) -> bool:
    """Whether the tool wrote exactly one line, an error, and no traceback."""
    lines = tool_lines(stderr)
    return len(lines) == 1 and lines[0].startswith("tfremat: error:") and "Traceback" not in stderr
