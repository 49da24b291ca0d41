"""Fits, under MirroredStrategy over 2 logical CPUs, each model that
``tests/<module>.py``'s ``mirrored_variants()`` builds ({name: build}, each
build compiling its model), on that module's ``_data()``, and prints their
weights as JSON. A fresh process: logical devices must be set before TF runs.

    python tests/helpers/mirrored_fit.py test_layers
"""

import importlib
import json
import os
import sys

import tensorflow as tf

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
module = importlib.import_module(sys.argv[1])
x, y = module._data()
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
out = {}
for name, build in module.mirrored_variants().items():
    with strategy.scope():
        net = build()
    net.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    out[name] = [w.tolist() for w in net.get_weights()]
print(json.dumps(out))
