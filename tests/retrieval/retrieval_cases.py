"""Queries with a known answer in the fixture corpus (tests/retrieval/fixtures/corpus.jsonl)."""

# query → title of the passage that must be in the top k (written for the fixture corpus)
EXPECTED = {
    "capital of Ghana Accra": "Ghana",
    "Scottish general murders King Duncan after the witches' prophecy": "Macbeth",
    "sorcerer Prospero on an island": "The Tempest",
    "largest hot desert in the world": "Sahara",
    "hormone that regulates blood glucose": "Insulin",
    "first woman to win a Nobel Prize": "Marie Curie",
    "river flowing through Vienna and Budapest to the Black Sea": "Danube",
    "flightless seabirds of Antarctica": "Penguin",
}
