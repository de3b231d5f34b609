"""Twenty JSON schemas, each with a prompt, for the constrained-decoding tests (offline
Engine and HTTP), the grammar benchmark and the soak. Together they cover nested objects,
arrays with item bounds, enums, bounded integers and numbers, optional fields,
`$defs`/`$ref`, `anyOf`, and strings bounded with maxLength (a 135M model would otherwise
write strings until max_tokens)."""

from __future__ import annotations

POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9},
        "y": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["x", "y"],
}
NAME = {"type": "string", "maxLength": 12}

SCHEMAS: dict[str, tuple[str, dict]] = {
    "nested object": (
        "Describe a person with an address as JSON.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "address": {
                    "type": "object",
                    "properties": {
                        "city": NAME,
                        "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
                    },
                    "required": ["city", "zip"],
                },
            },
            "required": ["name", "address"],
        },
    ),
    "array with min/max items": (
        "List some colors as JSON.",
        {
            "type": "object",
            "properties": {
                "colors": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 8},
                    "minItems": 2,
                    "maxItems": 3,
                }
            },
            "required": ["colors"],
        },
    ),
    "enum": (
        "Pick a color as JSON.",
        {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}},
            "required": ["color"],
        },
    ),
    "integer and number bounds": (
        "Give a person's age and test score as JSON.",
        {
            "type": "object",
            "properties": {
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "score": {"type": "number", "minimum": 0, "maximum": 10},
            },
            "required": ["age", "score"],
        },
    ),
    "optional field": (
        "A book as JSON.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 10},
                "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            },
            "required": ["title"],
        },
    ),
    "$defs and $ref": (
        "Two points as JSON.",
        {
            "$defs": {"point": POINT},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
            "required": ["a", "b"],
        },
    ),
    "anyOf": (
        "A value as JSON.",
        {
            "type": "object",
            "properties": {
                "v": {
                    "anyOf": [
                        {"type": "integer", "minimum": 0, "maximum": 100},
                        {"type": "boolean"},
                    ]
                }
            },
            "required": ["v"],
        },
    ),
    "string maxLength": (
        "One short word as JSON.",
        {
            "type": "object",
            "properties": {"word": {"type": "string", "maxLength": 5}},
            "required": ["word"],
        },
    ),
    "top-level array": (
        "A few digits as a JSON array.",
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 1, "maximum": 9},
            "minItems": 1,
            "maxItems": 4,
        },
    ),
    "boolean and nested enum": (
        "A status as JSON.",
        {
            "type": "object",
            "properties": {
                "ok": {"type": "boolean"},
                "level": {
                    "type": "object",
                    "properties": {"name": {"enum": ["low", "high"]}},
                    "required": ["name"],
                },
            },
            "required": ["ok", "level"],
        },
    ),
    "array of objects": (
        "Two products with prices as JSON.",
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": NAME,
                            "price": {"type": "number", "minimum": 0, "maximum": 1000},
                        },
                        "required": ["name", "price"],
                    },
                }
            },
            "required": ["items"],
        },
    ),
    "integer enum": (
        "Rate the movie from 1 to 5 as JSON.",
        {
            "type": "object",
            "properties": {"stars": {"enum": [1, 2, 3, 4, 5]}},
            "required": ["stars"],
        },
    ),
    "anyOf of objects": (
        "A shape as JSON.",
        {
            "type": "object",
            "properties": {
                "shape": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {
                                "radius": {"type": "integer", "minimum": 1, "maximum": 10}
                            },
                            "required": ["radius"],
                        },
                        {
                            "type": "object",
                            "properties": {
                                "side": {"type": "integer", "minimum": 1, "maximum": 10}
                            },
                            "required": ["side"],
                        },
                    ]
                }
            },
            "required": ["shape"],
        },
    ),
    "nullable field": (
        "A user and their nickname, if any, as JSON.",
        {
            "type": "object",
            "properties": {
                "user": NAME,
                "nickname": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
            },
            "required": ["user", "nickname"],
        },
    ),
    "recursive $ref": (
        "A small tree of numbers as JSON.",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "value": {"type": "integer", "minimum": 0, "maximum": 9},
                        "children": {
                            "type": "array",
                            "maxItems": 2,
                            "items": {"$ref": "#/$defs/node"},
                        },
                    },
                    "required": ["value"],
                }
            },
            "$ref": "#/$defs/node",
        },
    ),
    "negative number range": (
        "A temperature reading in Celsius as JSON.",
        {
            "type": "object",
            "properties": {
                "celsius": {"type": "number", "minimum": -50, "maximum": 50},
                "city": NAME,
            },
            "required": ["celsius", "city"],
        },
    ),
    "array of enums": (
        "The days you work, as JSON.",
        {
            "type": "object",
            "properties": {
                "days": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                }
            },
            "required": ["days"],
        },
    ),
    "deeply nested": (
        "A company with a department and its manager as JSON.",
        {
            "type": "object",
            "properties": {
                "company": {
                    "type": "object",
                    "properties": {
                        "dept": {
                            "type": "object",
                            "properties": {
                                "manager": {
                                    "type": "object",
                                    "properties": {
                                        "name": NAME,
                                        "age": {"type": "integer", "minimum": 18, "maximum": 99},
                                    },
                                    "required": ["name", "age"],
                                },
                            },
                            "required": ["manager"],
                        }
                    },
                    "required": ["dept"],
                }
            },
            "required": ["company"],
        },
    ),
    "several optional fields": (
        "A contact card as JSON.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "phone": {"type": "string", "maxLength": 12},
                "email": {"type": "string", "maxLength": 20},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name"],
        },
    ),
    "const and boolean": (
        "Confirm the order as JSON.",
        {
            "type": "object",
            "properties": {
                "kind": {"const": "order"},
                "confirmed": {"type": "boolean"},
                "count": {"type": "integer", "minimum": 1, "maximum": 5},
            },
            "required": ["kind", "confirmed", "count"],
        },
    ),
}
