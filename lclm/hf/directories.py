"""Files and directories of an export, readable by every user whatever the umask: files
0o644, directories 0o755; and local copies of HuggingFace directories on object storage."""

import contextlib
import os
import re
import tempfile

from lclm import storage
from lclm.errors import StartupError

# the files of a HuggingFace directory that lclm reads: config, tokenizer, safetensors weights
# and their index (never a pickled *.bin or *.pth, never code)
_READ = re.compile(
    r"config\.json|tokenizer\.json|tokenizer_config\.json|tokenizer\.model"
    r"|special_tokens_map\.json|.+\.safetensors(\.index\.json)?"
)


def world_readable(path: str, directory: bool = False) -> None:
    os.chmod(path, 0o755 if directory else 0o644)


def make_dir(path: str) -> None:
    """`os.makedirs`, with every directory it creates 0o755."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    os.makedirs(missing[0] if missing else path, exist_ok=True)
    for d in missing:
        world_readable(d, directory=True)


@contextlib.contextmanager
def local_copy(path: str):
    """`path` itself when it is local; for a gs:// or s3:// path a temporary local copy of the
    file, or of the HuggingFace directory's files that lclm reads (config.json, the
    tokenizer's, the safetensors weights and their index), removed when the block ends.
    Safetensors are read by memory-mapping and seeking, which only local files allow. A
    missing path gives an empty copy, so that its reader reports it in its own words; a
    StartupError or FileNotFoundError raised in the block names `path`, not the copy."""
    if not storage.is_remote(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="lclm-hf-") as tmp:
        local = os.path.join(tmp, storage.basename(path) or "copy")
        if storage.isfile(path):
            storage.download(path, local)
        else:
            os.makedirs(local)
            for name in storage.listdir(path):
                if _READ.fullmatch(name):
                    storage.download(storage.join(path, name), os.path.join(local, name))
        try:
            yield local
        except (StartupError, FileNotFoundError) as e:
            if local not in str(e):
                raise
            raise type(e)(str(e).replace(local, path)) from None
