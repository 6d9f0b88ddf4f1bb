"""The data statistics table at start names each source whole (issue 76 item 9: the source
column was cut from the left, `regpt:.../sharegpt.jsonl` for `sharegpt:...`)."""

import logging
import shutil

from support import DEMO_CONFIG, DEMO_CORPUS, ROOT

from lclm.config import load_config
from lclm.config.run_config import run_config
from lclm.data.loader import HostBatches
from lclm.data.tokenizer import Tokenizer
from lclm.parallel import make_mesh


def test_the_statistics_table_names_each_source_whole(tmp_path, caplog):
    folder = tmp_path / "a folder whose name alone is longer than the old column"
    folder.mkdir()
    chats = str(folder / "sharegpt.jsonl")
    shutil.copy(f"{ROOT}/data/demo/sharegpt.jsonl", chats)
    config = load_config(DEMO_CONFIG)
    config.data.update(
        path=f"sharegpt:{chats}@0.5?min_tokens=8,{DEMO_CORPUS}@0.5", seq_len=64, batch_size=4
    )
    loader = HostBatches(
        run_config(config), make_mesh(fsdp=2, sp=4), Tokenizer(config.data.tokenizer), prefetch=0
    )
    try:
        with caplog.at_level(logging.INFO, logger="lclm.data.loader"):
            loader.statistics(sample=20)
    finally:
        loader.close()
    (table,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    header, *rows = table.splitlines()[1:]
    names = [f"sharegpt:{chats}?min_tokens=8", f"text:{DEMO_CORPUS}"]
    width = max(map(len, names))  # the column holds the longest name, and so the counts line up
    assert [row[: width + 1].rstrip() for row in rows] == names
    assert header[: width + 1].rstrip() == "source" and header[width:].startswith("   documents")
