#!/usr/bin/env python3
"""Reads a TensorBoard event file as TensorBoard does (TFRecord framing with
masked CRC-32C checks, tensorflow.Event and Summary protocol buffers),
written here from those formats' definitions, and compares its scalars with
a metrics file.

    tfevents.py EVENTS_DIR METRICS.jsonl
"""
import glob
import json
import struct
import sys


def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def masked(crc):
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def varint(buf, at):
    value, shift = 0, 0
    while True:
        b = buf[at]
        at += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, at


def fields(buf):
    at = 0
    while at < len(buf):
        key, at = varint(buf, at)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, at = varint(buf, at)
        elif kind == 1:
            value, at = buf[at:at + 8], at + 8
        elif kind == 5:
            value, at = buf[at:at + 4], at + 4
        elif kind == 2:
            n, at = varint(buf, at)
            value, at = buf[at:at + n], at + n
        else:
            raise ValueError(f"wire type {kind}")
        yield number, kind, value


def events(path):
    data = open(path, "rb").read()
    at = 0
    while at < len(data):
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        (crc,) = struct.unpack("<I", data[at + 8:at + 12])
        assert crc == masked(crc32c(header)), "length CRC"
        body = data[at + 12:at + 12 + length]
        (crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
        assert crc == masked(crc32c(body)), "record CRC"
        at += 16 + length
        yield body


def main():
    files = glob.glob(sys.argv[1] + "/events.out.tfevents.*")
    assert len(files) == 1, files
    scalars = {}
    version = None
    for body in events(files[0]):
        step = None
        values = []
        for number, kind, value in fields(body):
            if number == 2:
                step = value - (1 << 64) if value >= 1 << 63 else value
            elif number == 3:
                version = value.decode()
            elif number == 5:
                for n, _, v in fields(value):
                    if n != 1:
                        continue
                    tag = simple = None
                    for m, _, x in fields(v):
                        if m == 1:
                            tag = x.decode()
                        elif m == 2:
                            (simple,) = struct.unpack("<f", x)
                    values.append((tag, simple))
        for tag, simple in values:
            scalars.setdefault(tag, {})[step] = simple
    assert version == "brain.Event:2", version
    metrics = [json.loads(line) for line in open(sys.argv[2])]
    compared = 0
    for record in metrics:
        for tag, value in record.items():
            if tag in scalars:
                got = scalars[tag].get(record["step"])
                want = struct.unpack("<f", struct.pack("<f", value))[0]
                # The metrics print these to 9 digits (float32 exactly);
                # times and rates with a few decimals.
                if tag in ("loss", "lr", "grad_norm", "val_loss"):
                    assert got == want, (tag, record["step"], got, want)
                else:
                    assert abs(got - want) <= 1e-3 * max(1.0, abs(want)), \
                        (tag, record["step"], got, want)
                compared += 1
    print(f"{version}: {len(scalars)} tags ({', '.join(sorted(scalars))}), "
          f"{compared} values equal the metrics'")


if __name__ == "__main__":
    main()
