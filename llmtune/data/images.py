"""The images of a multimodal model's samples: read, sized, processed by the family's own processor, and their
tokens put in the text.

A sample's images are named in its canonical form (formats.py) as a list of references, and each one's place in
the turns is LLaMA-Factory's `<image>` marker (TRL's image parts are read as one). Encoding a sample with images:
1. the markers become the text the model's own chat template writes for an image part (`placeholder`: Qwen's
   `<|vision_start|><|image_pad|><|vision_end|>`, LLaVA's `<image>`), so that every template, the model's or a
   LLaMA-Factory name's, renders them where the data put them;
2. the sample is tokenized as any conversation (templates.encode_sample), the labels on the assistant's turns;
3. each image's one token (the processor's `image_token`) is replaced by the tokens the processor gives that image
   (Qwen: one per merged patch of its grid), never labelled, and the processor's tensors of the image (Qwen's
   patches and grid) are kept with the sample, one safetensors blob per image (`blob`), in the order of their
   tokens: packing puts several samples' images in a row in the order of their documents, and the collator
   concatenates them for the micro-batch (collate.image_inputs), as the model's vision tower takes them.

The processor is transformers' class for the family (AutoProcessor's), built from the tokenizer and the image
processor alone (`family_processor`): several insist on a video processor, which needs torchvision, whose wheels
here do not load beside the CPU torch; images never use it. The image processor is its PIL backend
(`Qwen2VLImageProcessorPil`), whatever else is installed: the same pixels on every machine, and the data cache
holds them.

The run's tokenizer carries its ImageInputs (`attach`, `of`), as transformers' processor carries its tokenizer:
every function that tokenizes samples (sft, preference, the preview, the cache key) reaches both through the one
argument it already takes.
"""

import base64
import io
import json
import re
from pathlib import Path

from llmtune.errors import UserError

IMAGE = "<image>"  # LLaMA-Factory's marker of an image in a turn's text
IMAGES = "images"  # a built row's column of its images' blobs, in the order of their tokens
# LLaMA-Factory's image_max_pixels / image_min_pixels defaults (its ProcessorArguments): an image is scaled, its
# aspect kept, into this many pixels before its processor sees it.
MAX_PIXELS, MIN_PIXELS = 768 * 768, 32 * 32
DATA_URI = "data:image/"  # an image held in the row itself (a PIL image or bytes in the data), base64
PROCESSOR_FILE = "preprocessor_config.json"  # the image processor's settings, in a model's or processor's folder
PROCESSOR_SETTINGS = "processor_config.json"  # the processor's own, beside them
# How an image's tokens are made, in the data cache's key: 2, without the tokenizer's special tokens (a row cached
# before held a BOS-adding tokenizer's BOS before each image).
IMAGE_TOKENS = 2
BLANK_SIDE = 64  # the blank image a micro-batch without images gives the vision tower (collate.image_inputs)


def of(tokenizer):
    """The tokenizer's ImageInputs, None for a text-only model's."""
    from llmtune.model.multimodal import IMAGE_INPUTS  # torch's; formats.py reads this module torch-free

    return getattr(tokenizer, IMAGE_INPUTS, None)


def attach(tokenizer, folders: tuple, model_config, data_cfg) -> None:
    """Give the run's tokenizer the ImageInputs of a multimodal model (its config has a vision_config); nothing for a
    text-only model. Before the recipe's chat template replaces the model's own: the placeholder is the text the
    model's template writes for an image. The image processor's settings (preprocessor_config.json) are those of the
    first of `folders` that has them (the model's, then model.tokenizer's: a processor's folder)."""
    if getattr(model_config, "vision_config", None) is None:
        return
    folders = [folder for folder in folders if folder and (Path(folder) / PROCESSOR_FILE).is_file()]
    if not folders:
        raise UserError(f"model: {model_config.model_type} is a vision-language model, and its image processor's "
                        f"settings ({PROCESSOR_FILE}) are in neither model.name_or_path nor model.tokenizer; name the "
                        "model's folder, which holds them")
    from llmtune.model.multimodal import IMAGE_INPUTS

    processor = family_processor(model_config.model_type, folders[0], tokenizer)
    setattr(tokenizer, IMAGE_INPUTS, ImageInputs(processor, image_placeholder(tokenizer, processor.image_token),
                                               data_cfg.image_max_pixels, data_cfg.image_min_pixels, folders[0]))


def family_processor(model_type: str, folder: str, tokenizer):
    """transformers' processor of the family (AutoProcessor's class) with the folder's image processor, PIL backend,
    and no video processor."""
    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    # By the family, not by the image_processor_type the file names: released folders name classes transformers 5
    # renamed (Qwen2.5-VL's Qwen2_5_VLImageProcessor), which AutoImageProcessor then refuses. A family whose entry
    # names no PIL backend (Qwen3-VL-MoE) takes the PIL class of the one its file names.
    named = json.loads((Path(folder) / PROCESSOR_FILE).read_text()).get("image_processor_type", "")
    pil = (IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type) or {}).get("pil") or f"{named.removesuffix('Fast')}Pil"
    if not hasattr(transformers, pil):
        pil = None
    if model_type not in PROCESSOR_MAPPING_NAMES or not pil:
        raise UserError(f"model: transformers has no processor with a PIL image processor for {model_type}, so "
                        "llmtune cannot read its images; train it on text, or use a family docs/vision.md lists")
    image_processor = getattr(transformers, pil).from_pretrained(folder)
    processor_class = getattr(transformers, PROCESSOR_MAPPING_NAMES[model_type])
    wanted = processor_class.get_attributes()
    # The processor's own settings (LLaVA's patch size, Gemma 3's image tokens per image), where the folder has them.
    settings = Path(folder) / PROCESSOR_SETTINGS
    saved = json.loads(settings.read_text()) if settings.is_file() else {}
    parts = {"image_processor": image_processor, "tokenizer": tokenizer,
             **{key: value for key, value in saved.items() if key not in ("processor_class", "auto_map")}}
    try:
        if "video_processor" not in wanted:
            return processor_class(**parts)
        return _without_video(processor_class)(**parts, video_processor=None)
    except ImportError as err:  # SmolVLM's processor needs num2words (for videos, which llmtune never reads)
        raise UserError(f"model: {model_type}'s processor needs a package this environment lacks ({err}); "
                        "pip install 'llmtune[vision]' installs those of every family docs/vision.md lists") from None


def _without_video(processor_class):
    """The processor class, taking None for its video processor: ProcessorMixin checks every part's class, and the
    video processor's lookup needs torchvision."""

    class ImagesOnly(processor_class):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = processor_class.__name__
    return ImagesOnly


def image_placeholder(tokenizer, image_token: str) -> str:
    """The text the tokenizer's chat template writes for an image part of a user turn (found by rendering one with
    and without it), where that text holds the processor's image token; else the token alone (a template that
    renders no image parts, LLaMA-Factory's plugins' form)."""
    if not tokenizer.chat_template:
        return image_token
    text = "\x00"
    try:
        with_image, without = (tokenizer.apply_chat_template(
            [{"role": "user", "content": parts + [{"type": "text", "text": text}]}], tokenize=False)
            for parts in ([{"type": "image"}], []))
    except Exception:  # a template that reads content as a string alone
        return image_token
    start = without.find(text)
    found = with_image[start:with_image.find(text, start)] if start >= 0 else ""
    return found if image_token in found and found.startswith(found.strip()) else image_token


class ImageInputs:
    """A multimodal model's image processing: `processor` (family_processor) and LLaMA-Factory's pixel bounds;
    `folder`: where its settings were read (model/multimodal.save_processor writes them into every export)."""

    def __init__(self, processor, placeholder: str, max_pixels: int, min_pixels: int, folder: str):
        self.processor, self.placeholder, self.folder = processor, placeholder, Path(folder)
        self.max_pixels, self.min_pixels = max_pixels, min_pixels
        self.image_token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
        self._blank = None

    def key(self) -> list:
        """What decides the built rows besides the tokenizer: the data cache's key (data/build.cache_key)."""
        return [IMAGE_TOKENS, type(self.processor).__name__, self.processor.image_processor.to_json_string(),
                self.placeholder, self.max_pixels, self.min_pixels]

    def placed(self, messages: list[dict]) -> list[dict]:
        """The messages with each image marker made the template's placeholder."""
        return [{**m, "content": m["content"].replace(IMAGE, self.placeholder)} if isinstance(m.get("content"), str)
                else m for m in messages]

    def expand(self, input_ids: list[int], labels: list[int], images: list[str], where: str):
        """(input_ids, labels, one blob per image) of a tokenized sample whose placeholders hold one image token
        each: each made the processor's tokens of its image, unlabelled."""
        from llmtune.model.loss import IGNORE_INDEX  # torch's; formats.py reads this module torch-free

        at = [i for i, token in enumerate(input_ids) if token == self.image_token_id]
        if len(at) != len(images):
            raise UserError(f"{where}: the rendered conversation holds {len(at)} image tokens for {len(images)} "
                            "images; the chat template may drop turns that hold them (an image belongs in a turn "
                            "the template renders)")
        ids, kept, blobs, last = [], [], [], 0
        for position, image in zip(at, images):
            tokens, tensors = self.encoded(load_image(image, where, self.max_pixels, self.min_pixels))
            ids += input_ids[last:position] + tokens
            kept += labels[last:position] + [IGNORE_INDEX] * len(tokens)
            blobs.append(blob(tensors))
            last = position + 1
        return ids + input_ids[last:], kept + labels[last:], blobs

    def encoded(self, image) -> tuple[list[int], dict]:
        """(the processor's tokens of one image, its tensors for the model: those its image processor names)."""
        # Without the tokenizer's special tokens: one that begins every text with BOS (Gemma's, Llama's) would put
        # one before each image's tokens.
        out = self.processor(text=[self.processor.image_token], images=[image], add_special_tokens=False,
                             return_tensors="pt")
        names = [name for name in self.processor.image_processor.model_input_names if name in out]
        return out["input_ids"][0].tolist(), {name: out[name] for name in names}

    def collapsed(self, text: str) -> str:
        """`text` with each run of the token an image's tokens repeat (Qwen's <|image_pad|>) written once, with the
        run's length: `<|image_pad|>x16`."""
        from PIL import Image

        ids = self.encoded(Image.new("RGB", (BLANK_SIDE, BLANK_SIDE)))[0]
        token = self.processor.tokenizer.convert_ids_to_tokens(max(set(ids), key=ids.count))
        return re.sub(f"(?:{re.escape(token)}){{2,}}", lambda run: f"{token}x{len(run[0]) // len(token)}", text)

    def blank(self) -> bytes:
        """The blob of a blank image: what the vision tower encodes, multiplied by 0, for a micro-batch without
        images, so that every rank runs it on every micro-batch (its sharded blocks gather their weights
        together, and a trained tower's gradients exist on every rank)."""
        if self._blank is None:
            from PIL import Image

            self._blank = blob(self.encoded(Image.new("RGB", (BLANK_SIDE, BLANK_SIDE), (255, 255, 255)))[1])
        return self._blank


def column_features() -> dict:
    import datasets

    return {IMAGES: datasets.List(datasets.Value("binary"))}


def merged(blobs: list[bytes]) -> dict:
    """Images as the model takes them: each tensor concatenated over the images, in order, its other sizes padded with
    zeros to the largest (LLaVA-NeXT's patches of one image, Idefics3's crops: where the processor pads a batch of
    images itself, and the model drops what the image's size or an all-zero crop says is padding)."""
    import torch
    import torch.nn.functional as F

    tensors = [unblob(data) for data in blobs]
    out = {}
    for name in tensors[0] if tensors else ():
        parts = [found[name] for found in tensors]
        largest = [max(sizes) for sizes in zip(*(part.shape for part in parts))]
        out[name] = torch.cat([F.pad(part, [side for size, most in zip(reversed(part.shape[1:]), reversed(largest[1:]))
                                            for side in (0, most - size)]) for part in parts])
    return out


def blob(tensors: dict) -> bytes:
    from safetensors.torch import save

    return save({name: tensor.contiguous() for name, tensor in tensors.items()})


def unblob(data: bytes) -> dict:
    from safetensors.torch import load

    return load(data)


def reference(value, base: Path | None, where: str) -> str:
    """An image as a canonical sample names it: a file's absolute path (a relative one found beside the data, in
    LLaMA-Factory's dataset_dir, else in the working directory), or the image's bytes as a data URI (a PIL image,
    or datasets' {"bytes", "path"} of an Image column)."""
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        value = value["bytes"] or value["path"]
    if isinstance(value, (bytes, bytearray)):
        return DATA_URI + "bytes;base64," + base64.b64encode(value).decode()
    if hasattr(value, "save"):  # a PIL image
        data = io.BytesIO()
        value.save(data, format="PNG")
        return DATA_URI + "png;base64," + base64.b64encode(data.getvalue()).decode()
    if not isinstance(value, str) or not value:
        raise UserError(f"{where}: an image must be a file path, a PIL image or image bytes, not {value!r}")
    if value.startswith(DATA_URI):
        return value
    if value.startswith(("http://", "https://")):
        raise UserError(f"{where}: the image {value} is a URL; llmtune reads no network at run time: download it "
                        "and name the file")
    path = Path(value)
    for candidate in ([path] if path.is_absolute() else [base / path] if base else []) + [Path.cwd() / path]:
        if candidate.is_file():
            return str(candidate.resolve())
    raise UserError(f"{where}: the image {value} does not exist (looked in {base or Path.cwd()}"
                    f"{' and ' + str(Path.cwd()) if base else ''}); fix the path or add the file")


def load_image(image: str, where: str, max_pixels: int, min_pixels: int):
    """A canonical reference's image in RGB, scaled (its aspect kept) into [min_pixels, max_pixels] pixels as
    LLaMA-Factory's plugins scale it before the processor."""
    picture = _decoded(image, where, lambda opened: opened.convert("RGB"))
    pixels = picture.width * picture.height
    if pixels > max_pixels or pixels < min_pixels:
        factor = ((max_pixels if pixels > max_pixels else min_pixels) / pixels) ** 0.5
        picture = picture.resize((max(1, int(picture.width * factor)), max(1, int(picture.height * factor))))
    return picture


def check_decodable(image: str, where: str) -> None:
    """A canonical reference's image is one PIL can read, checked without decoding its pixels (PIL's verify)."""
    _decoded(image, where, lambda opened: opened.verify())


def _decoded(image: str, where: str, read):
    """read(the opened image), or the row's one-line refusal where it cannot be read."""
    from PIL import Image, UnidentifiedImageError

    source = io.BytesIO(base64.b64decode(image.split(",", 1)[1])) if image.startswith(DATA_URI) else image
    try:
        with Image.open(source) as opened:
            return read(opened)
    except (UnidentifiedImageError, OSError, SyntaxError) as err:  # verify raises SyntaxError on a broken PNG
        name = "the image in the row" if image.startswith(DATA_URI) else image
        raise UserError(f"{where}: {name} cannot be decoded as an image ({err}); replace or remove it") from None


def no_vision_tower(where: str, unit: str) -> UserError:
    """The refusal of a sample (`unit`: sample, pair) with images for a text model."""
    return UserError(f"{where}: the {unit} holds images, and the model is a text model with no vision tower; train "
                     "a vision-language model on it, or leave the images out of the data")


def sample_images(sample: dict) -> list[str]:
    return sample.get("images") or []


def count_markers(messages: list[dict]) -> int:
    return sum(m["content"].count(IMAGE) for m in messages if isinstance(m.get("content"), str))


def check_count(messages: list[dict], images: list, where: str) -> None:
    """A sample's image markers and images agree in number (LLaMA-Factory's check)."""
    markers = count_markers(messages)
    if markers != len(images):
        raise UserError(f"{where}: the turns hold {markers} {IMAGE} markers for {len(images)} images; give one "
                        f"{IMAGE} where each image belongs, in order")

