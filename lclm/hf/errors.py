"""The error of every HuggingFace directory lclm refuses."""

from lclm.errors import StartupError


class HFFormatError(StartupError):
    """A HuggingFace directory that lclm refuses to load. The message is one line that names
    the file and the tensor or config field at fault; a safetensors file that safetensors
    refuses to open is named as damaged, with safetensors' reason."""
