"""ddddocr (a captcha OCR whose models ship in its wheel, run with ``import onnxruntime``)
reading text drawn with Pillow; prints the text, its confidence and each step's most
likely character and probability as JSON."""

import io
import json
import sys

import ddddocr
import numpy as np
import onnxruntime
from PIL import Image, ImageDraw, ImageFont

out = {"ort": onnxruntime.__name__}
ocr = ddddocr.DdddOcr(show_ad=False)
for text in ("k7x3p", "q4m8w"):
    img = Image.new("RGB", (160, 60), "white")
    try:
        font = ImageFont.truetype("DejaVuSans-Bold.ttf", 36)
    except OSError:
        font = ImageFont.load_default(size=36)
    ImageDraw.Draw(img).text((10, 8), text, fill="black", font=font)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    res = ocr.classification(buf.getvalue(), probability=True)
    p = np.asarray(res["probabilities"], dtype=np.float64).reshape(-1, len(res["charset"]))
    out[text] = [ocr.classification(buf.getvalue()), float(res["confidence"]),
                 p.argmax(1).tolist(), p.max(1).tolist()]
json.dump(out, sys.stdout)
