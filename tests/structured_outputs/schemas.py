"""A dozen JSON schemas of the shapes users constrain to: nested objects, arrays, enums,
numbers with bounds, required fields, strings with patterns. Bounded (maxLength, maxItems) so
that a small model's greedy output ends within the tests' max_tokens."""

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
     "required": ["colour"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                      "population": {"type": "integer", "minimum": 1000,
                                                     "maximum": 99999999}},
     "required": ["city", "population"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string",
                                                                           "maxLength": 8},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"point": {
        "type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                                         "y": {"type": "number", "minimum": -10, "maximum": 10}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {
        "type": "integer", "minimum": 0, "maximum": 10}, "minItems": 2, "maxItems": 4}},
     "required": ["scores"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "role": {"enum": ["admin", "guest"]}}, "required": ["id", "role"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50,
                                                      "maximum": 50},
                                      "unit": {"const": "celsius"}},
     "required": ["temperature", "unit"]},
    {"type": "array", "items": {"type": "object", "properties": {
        "k": {"type": "string", "maxLength": 6}}, "required": ["k"]}, "minItems": 1,
     "maxItems": 2},
    {"type": "object", "properties": {"date": {"type": "string",
                                               "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                                      "note": {"type": "string", "maxLength": 10}},
     "required": ["date"]},
]

PROMPTS = [
    "Describe a person as JSON.",
    "Pick a colour and answer in JSON.",
    "Give a city and its population as JSON.",
    "Give some tags for a blog post about cooking as JSON.",
    "Give a point on a plane as JSON.",
    "Is the sky blue? Answer in JSON.",
    "Give a product code as JSON.",
    "Give a few scores out of ten as JSON.",
    "Describe a user account as JSON.",
    "What is the weather like? Answer in JSON.",
    "List some keys as JSON.",
    "Give today's date as JSON.",
]
