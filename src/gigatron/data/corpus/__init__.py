"""Corpus tools (`gigatron data <tool>`): Wikipedia extraction, cleaning, de-duplication,
decontamination and URL blacklists over loose JSON lines, streamed, each output atomic."""
