"""A recipe's image rows checked before any process starts (run/preflight.py): what the data build would find only
once the run's processes have started is one line naming the row here. Each source with an images column is read
into canonical rows, which checks each sample's <image> markers against its images and where each image is (a file
that exists, not a URL: formats.py, images.reference); then each image is opened (images.check_decodable), and images
given to a text model are refused. A source without an images column (TRL's images given inline in the turns alone)
is checked as its data is built."""

import datasets

from llmtune.data import images
from llmtune.data.build import canonical_rows
from llmtune.data.formats import canonical_columns
from llmtune.data.registry import Source, split_sources
from llmtune.data.sources import load_source

COLUMN = "images"  # the column every form reads images from unless a dataset_info.json entry names another
UNITS = ("sample", "pair")  # the canonical rows that hold images (formats.canonical_columns): sft's, dpo's and rm's


def check_image_rows(config, multimodal: bool) -> None:
    """`multimodal`: whether the model has a vision tower. Quiet: datasets' progress bars are the data build's."""
    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        _check(config, multimodal)
    finally:
        if shown:
            datasets.enable_progress_bars()


def _check(config, multimodal: bool) -> None:
    for split in ("train", "val", "test"):
        for source in split_sources(config.data, config.task, split):
            if not has_images_column(source, config.data):
                continue
            rows, form = canonical_rows(source, config.task, config.data, streaming=False)
            unit = canonical_columns(form)[0]
            if unit not in UNITS:
                continue
            for index, row in enumerate(rows):
                where = f"{source.pattern}: row {index + 1}"
                found = images.sample_images(row[unit])
                if found and not multimodal:
                    raise images.no_vision_tower(where, unit)
                for image in found:
                    images.check_decodable(image, where)


def has_images_column(source: Source, data_cfg) -> bool:
    """Whether the source's rows have the column its form reads images from."""
    column = source.row_format.columns.get(COLUMN) if source.row_format else COLUMN
    return column is not None and \
        column in load_source(source.pattern, source.key, text_sample_by=data_cfg.text_sample_by).column_names
