"""``onnxruntime.capi`` on Kiln: the layer onnxruntime implements in C++, here in Python."""
