"""Capture: the user's forward (model + loss) as Kiln IR, via torch.export."""
from kiln.capture.export import capture, extract_loss  # noqa: F401
