"""Errors Kiln raises at users. Each message names the problem and where it is."""


class KilnError(Exception):
    """Base class for every error Kiln raises on purpose."""


class CaptureError(KilnError):
    """The forward (model + loss) could not be captured as an ATen graph."""


class UnsupportedError(KilnError):
    """The captured program uses a construct Kiln cannot train correctly."""


class InputError(KilnError):
    """step(...) was called with inputs that do not fit (types, shapes, dtypes, cache bound)."""


class StepError(KilnError):
    """A compiled step failed while running; the message names the op, its module and the generated line."""
