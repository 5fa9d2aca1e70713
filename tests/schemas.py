"""Constraints of the shapes users send, for tests/test_structured.py and the `structured` fuzz target:
JSON Schemas as extraction, classification and API payloads use them (nested objects, bounded arrays,
enums, string formats and patterns, anyOf, required fields, numbers with ranges), regular expressions
and grammars (Lark, and llama.cpp's GBNF)."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 24}

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130},
                       "email": {"type": "string", "format": "email", "maxLength": 40}},
        "required": ["name", "age"], "additionalProperties": False},
    "invoice": {
        "type": "object",
        "properties": {
            "invoice_id": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
            "date": {"type": "string", "format": "date"},
            "customer": {"type": "object", "properties": {"name": NAME, "country": {"enum": ["FR", "DE", "US", "JP"]}},
                         "required": ["name", "country"], "additionalProperties": False},
            "lines": {"type": "array", "minItems": 1, "maxItems": 3,
                      "items": {"type": "object",
                                "properties": {"item": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                                               "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000}},
                                "required": ["item", "qty", "price"], "additionalProperties": False}},
            "paid": {"type": "boolean"}},
        "required": ["invoice_id", "date", "customer", "lines", "paid"], "additionalProperties": False},
    "sentiment": {
        "type": "object",
        "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["label", "confidence"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4},
    "event": {
        "type": "object",
        "properties": {"title": NAME, "when": {"type": "string", "format": "date-time"},
                       "where": {"anyOf": [{"type": "null"},
                                           {"type": "object", "properties": {"city": NAME, "room": {"type": "integer",
                                                                                                    "minimum": 1,
                                                                                                    "maximum": 500}},
                                            "required": ["city"], "additionalProperties": False}]}},
        "required": ["title", "when", "where"], "additionalProperties": False},
    "answer": {
        "type": "object",
        "properties": {"answer": {"anyOf": [{"type": "integer", "minimum": -1000, "maximum": 1000},
                                            {"type": "string", "maxLength": 16}]},
                       "steps": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 30}}},
        "required": ["answer"], "additionalProperties": False},
    "ticket": {
        "$defs": {"priority": {"enum": ["low", "medium", "high"]}},
        "type": "object",
        "properties": {"id": {"type": "string", "format": "uuid"}, "priority": {"$ref": "#/$defs/priority"},
                       "assignee": {"type": ["string", "null"], "maxLength": 20},
                       "score": {"type": "number", "minimum": -5.5, "maximum": 5.5}},
        "required": ["id", "priority", "assignee", "score"], "additionalProperties": False},
}

PROMPTS = {
    "person": "Write the person Ann Lee, 34, ann@example.com as JSON.",
    "invoice": "Invoice INV-0042 of 2024-03-01 to Jean Dupont in France: 2 chairs at 49.5, paid. As JSON.",
    "sentiment": "Classify the sentiment of: 'I loved this film.' Answer as JSON.",
    "tags": "Give tags for a post about baking bread, as a JSON list.",
    "event": "A meeting called Standup on 2025-01-06 at 09:30 UTC in Paris, room 12. As JSON.",
    "answer": "What is 17 + 25? Answer as JSON.",
    "ticket": "Open a high-priority ticket for the broken printer, assigned to nobody. As JSON.",
}

REGEXES = {
    "yes_no": r"(yes|no)",
    "date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "phone": r"\+?[0-9]{1,3} [0-9]{3} [0-9]{3} [0-9]{3,4}",
    "words": r"[A-Z][a-z]{1,10}( [a-z]{1,10}){2,5}\.",
}

GRAMMARS = {
    # Lark, as llguidance reads it
    "arith": 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,4}/\n',
    "choice": 'start: "red" | "green" | "blue"\n',
    # llama.cpp's GBNF
    "gbnf_list": 'root ::= item ("," " "? item){0,3}\nitem ::= [a-z]{1,8}\n',
}
