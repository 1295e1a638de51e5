"""Small Keras models shared by the TensorFlow tests (extraction and the compiled step).

Each builder takes a seed so that weights are reproducible; all use static input shapes.
"""

import keras


def small_convnet(input_shape=(32, 32, 3), classes=10, channels=16, seed=0):
    """A residual conv net: conv-BN-ReLU, a residual Add, a Concatenate, dropout and a Dense head.

    Forward layer calls (12): conv1, bn1, relu1, conv2, bn2, add, relu2, conv3, concat,
    dropout, flatten, head.
    """
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    x = keras.Input(input_shape, name="image")
    c1 = layers.Conv2D(channels, 3, padding="same", name="conv1")(x)
    b1 = layers.BatchNormalization(name="bn1")(c1)
    r1 = layers.ReLU(name="relu1")(b1)
    c2 = layers.Conv2D(channels, 3, padding="same", name="conv2")(r1)
    b2 = layers.BatchNormalization(name="bn2")(c2)
    added = layers.Add(name="add")([r1, b2])
    r2 = layers.ReLU(name="relu2")(added)
    c3 = layers.Conv2D(channels, 1, name="conv3")(r2)
    cat = layers.Concatenate(name="concat")([r2, c3])
    dropped = layers.Dropout(0.3, seed=seed, name="dropout")(cat)
    flat = layers.Flatten(name="flatten")(dropped)
    out = layers.Dense(classes, activation="softmax", name="head")(flat)
    return keras.Model(x, out, name="small_convnet")


def unet(input_shape=(32, 32, 3), classes=2, base=8, depth=2, seed=0):
    """A U-Net with skip connections across ``depth`` levels and a per-pixel softmax."""
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    x = keras.Input(input_shape, name="image")
    h = x
    skips = []
    for level in range(depth):
        h = layers.Conv2D(base * 2**level, 3, padding="same", activation="relu", name=f"down{level}_conv")(h)
        skips.append(h)
        h = layers.MaxPooling2D(name=f"down{level}_pool")(h)
    h = layers.Conv2D(base * 2**depth, 3, padding="same", activation="relu", name="bottom_conv")(h)
    for level in reversed(range(depth)):
        h = layers.UpSampling2D(name=f"up{level}_upsample")(h)
        h = layers.Concatenate(name=f"up{level}_concat")([h, skips[level]])
        h = layers.Conv2D(base * 2**level, 3, padding="same", activation="relu", name=f"up{level}_conv")(h)
    out = layers.Conv2D(classes, 1, activation="softmax", name="head")(h)
    return keras.Model(x, out, name="unet")


def vgg_block_net(input_shape=(16, 16, 3), classes=10, channels=8, seed=0):
    """A VGG-style net: Conv2D(relu)-MaxPool blocks, a BatchNormalization-ReLU block,
    dropout and a Dense(relu) head: every layer kind with operator alternatives
    (:mod:`tfremat.runtime.layer_variants`)."""
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    x = keras.Input(input_shape, name="image")
    c1 = layers.Conv2D(channels, 3, padding="same", activation="relu", name="conv1")(x)
    p1 = layers.MaxPooling2D(2, name="pool1")(c1)
    c2 = layers.Conv2D(2 * channels, 3, padding="same", name="conv2")(p1)
    b2 = layers.BatchNormalization(name="bn2")(c2)
    r2 = layers.ReLU(name="relu2")(b2)
    p2 = layers.MaxPooling2D(3, strides=2, padding="same", name="pool2")(r2)
    flat = layers.Flatten(name="flatten")(p2)
    hidden = layers.Dense(4 * channels, activation="relu", name="fc")(flat)
    dropped = layers.Dropout(0.4, seed=seed, name="dropout")(hidden)
    out = layers.Dense(classes, activation="softmax", name="head")(dropped)
    return keras.Model(x, out, name="vgg_block_net")


def token_mlp_net(tokens=16, width=32, classes=10, seed=0):
    """A pre-norm transformer-style MLP over tokens: LayerNormalization, Dense(gelu) and
    Dense(silu) blocks with residual adds, a leaky ReLU and a mish activation: the layers
    whose alternatives recompute inside the backward or keep a sign mask, and silu, which
    needs none (:mod:`tfremat.runtime.layer_variants`)."""
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    x = keras.Input((tokens, width), name="tokens")
    h = layers.Dense(width, name="embed")(x)
    n1 = layers.LayerNormalization(name="norm1")(h)
    up = layers.Dense(2 * width, activation="gelu", name="up")(n1)
    h = layers.Add(name="residual1")([h, layers.Dense(width, name="down")(up)])
    n2 = layers.LayerNormalization(name="norm2")(h)
    gate = layers.Dense(width, activation="silu", name="gate")(n2)
    h = layers.Add(name="residual2")([h, gate])
    leaky = layers.LeakyReLU(0.1, name="leaky")(layers.Dense(width, name="mix")(h))
    mish = layers.Activation("mish", name="mish")(leaky)
    pooled = layers.GlobalAveragePooling1D(name="pool")(mish)
    out = layers.Dense(classes, activation="softmax", name="head")(pooled)
    return keras.Model(x, out, name="token_mlp_net")


def residual_chain(input_shape=(48, 48, 3), channels=8, blocks=12, classes=10, seed=0):
    """A residual chain whose activations dominate its memory: conv-BN-ReLU-dropout blocks
    added to the running sum, average pooling and a softmax head."""
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    x = keras.Input(input_shape)
    h = layers.Conv2D(channels, 3, padding="same", name="stem")(x)
    for b in range(blocks):
        r = layers.Conv2D(channels, 3, padding="same", name=f"b{b}_conv")(h)
        r = layers.BatchNormalization(name=f"b{b}_bn")(r)
        r = layers.ReLU(name=f"b{b}_relu")(r)
        r = layers.Dropout(0.1, seed=b, name=f"b{b}_drop")(r)
        h = layers.Add(name=f"b{b}_add")([h, r])
    h = layers.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(x, layers.Dense(classes, activation="softmax", name="head")(h), name="residual_chain")


def dense_mlp(features=256, width=512, depth=4, classes=10, seed=0):
    """A weight-heavy MLP (ReLU Dense layers and a softmax head): its optimizer's update
    temporaries are large next to its activations (benchmarks/optimizer_update.py)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,))
    hidden = inputs
    for _ in range(depth):
        hidden = keras.layers.Dense(width, activation="relu")(hidden)
    return keras.Model(inputs, keras.layers.Dense(classes, activation="softmax")(hidden), name="dense_mlp")


def keras_io_vit(image_size=32, patch_size=4, dim=64, heads=4, blocks=4, block_units=None, head=(256, 128),
                 classes=10, seed=0, name="vit_kerasio"):
    """keras.io's image-classification ViT (a Patches layer, a patch encoder with a position
    Embedding, pre-norm attention blocks, GELU MLPs with dropout, a dropout MLP head);
    ``block_units`` are a block's MLP widths (default ``(2 * dim, dim)``)."""
    from keras import layers, ops

    class Patches(layers.Layer):
        def __init__(self, size, **kwargs):
            super().__init__(**kwargs)
            self.size = size

        def call(self, images):
            patches = ops.image.extract_patches(images, size=self.size)
            rows, cols, dims = patches.shape[1], patches.shape[2], patches.shape[3]
            return ops.reshape(patches, (ops.shape(images)[0], rows * cols, dims))

    class PatchEncoder(layers.Layer):
        def __init__(self, num_patches, dim, **kwargs):
            super().__init__(**kwargs)
            self.num_patches = num_patches
            self.projection = layers.Dense(dim)
            self.position_embedding = layers.Embedding(num_patches, dim)

        def call(self, patch):
            positions = ops.expand_dims(ops.arange(0, self.num_patches, 1), axis=0)
            return self.projection(patch) + self.position_embedding(positions)

    def mlp(x, units, rate):
        for width in units:
            x = layers.Dropout(rate)(layers.Dense(width, activation=keras.activations.gelu)(x))
        return x

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((image_size, image_size, 3))
    encoded = PatchEncoder((image_size // patch_size) ** 2, dim)(Patches(patch_size)(inputs))
    for _ in range(blocks):
        x1 = layers.LayerNormalization(epsilon=1e-6)(encoded)
        attention = layers.MultiHeadAttention(num_heads=heads, key_dim=dim, dropout=0.1)(x1, x1)
        x2 = layers.Add()([attention, encoded])
        x3 = mlp(layers.LayerNormalization(epsilon=1e-6)(x2), block_units or (2 * dim, dim), 0.1)
        encoded = layers.Add()([x3, x2])
    representation = layers.Dropout(0.5)(layers.Flatten()(layers.LayerNormalization(epsilon=1e-6)(encoded)))
    outputs = layers.Dense(classes, activation="softmax")(mlp(representation, head, 0.5))
    return keras.Model(inputs, outputs, name=name)


def five_conv_net(seed=0):
    """Issue 33's report in small: five 3x3 convolutions at full 32x32 resolution, float32,
    compiled with Adam (tests/test_allocator_budget.py, benchmarks/allocator_check.py)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((32, 32, 3))
    hidden = inputs
    for _ in range(5):
        hidden = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(hidden)
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="categorical_crossentropy")
    return model


def tiny_bn_dropout_net(seed=0):
    """A conv, a batch norm and a dropout on 8x8x3 images, two outputs: the smallest model whose
    plain step has state to put back (the overlap and step-share tests)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.2)(h)
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(h))
    return keras.Model(inputs, outputs)


def tiny_bn_dropout_batch(seed=0):
    """A batch of 4 for :func:`tiny_bn_dropout_net`: images and regression targets."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.standard_normal((4, 8, 8, 3)).astype("float32"), rng.standard_normal((4, 2)).astype("float32")
