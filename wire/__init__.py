"""The wire contract (stdlib only): events, control keys and the rule for their values, policies,
the schema version, the ready lines. Everything else imports it; nothing defines these again."""
