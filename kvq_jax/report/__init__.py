"""`kvq report`: compare KV storage policies on captured (or embedded) real K/V."""
