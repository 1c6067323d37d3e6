"""A ResNet of configurable size (He et al. 2016) in Keras 3, for the TF examples."""

from __future__ import annotations


def resnet(keras, width, blocks, image_size, classes):
    inp = keras.Input((image_size, image_size, 3))
    x = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(inp)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    for stage, n in enumerate(blocks):
        for b in range(n):
            stride = 2 if (b == 0 and stage > 0) else 1
            ch = width * 2 ** stage
            y = keras.layers.Conv2D(ch, 3, strides=stride, padding="same", use_bias=False)(x)
            y = keras.layers.ReLU()(keras.layers.BatchNormalization()(y))
            y = keras.layers.BatchNormalization()(
                keras.layers.Conv2D(ch, 3, padding="same", use_bias=False)(y))
            if stride != 1 or x.shape[-1] != ch:
                x = keras.layers.Conv2D(ch, 1, strides=stride, use_bias=False)(x)
            x = keras.layers.ReLU()(keras.layers.Add()([x, y]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, keras.layers.Dense(classes)(x))
