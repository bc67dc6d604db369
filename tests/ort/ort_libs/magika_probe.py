"""Google's Magika (file-type detection; its model ships in its wheel, run with
``import onnxruntime``) on a few contents; prints labels and scores as JSON."""

import json
import sys

import onnxruntime
from magika import Magika

SAMPLES = {
    "python": b"import os\n\ndef main():\n    print(os.getcwd())\n\nif __name__ == '__main__':\n"
              b"    main()\n" * 3,
    "json": json.dumps({"a": [1, 2, 3], "b": {"c": "hello"}}, indent=2).encode() * 3,
    "html": b"<!DOCTYPE html><html><head><title>x</title></head><body><p>Hello</p></body>"
            b"</html>\n" * 4,
    "csv": b"name,age,city\nada,36,london\nalan,41,manchester\ngrace,85,new york\n" * 5,
    "c": b"#include <stdio.h>\nint main(void) {\n    printf(\"hi\\n\");\n    return 0;\n}\n" * 3,
}

m = Magika()
out = {"ort": onnxruntime.__name__}
for name, data in SAMPLES.items():
    r = m.identify_bytes(data)
    out[name] = [r.output.label, float(r.score)]
json.dump(out, sys.stdout)
