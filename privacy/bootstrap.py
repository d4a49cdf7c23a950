"""Opening a store at start-up, and the first admin key.

    store = open_store(StoreConfig())            # SQLite in the data dir, local master key
    path = ensure_admin_key(store, config)       # first start only: <data_dir>/admin.key (0600)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from privacy.config import MASTER_KEY_ENV, StoreConfig
from privacy.errors import MasterKeyError
from privacy.history import HistoryStore
from privacy.keychain import CHECK_PREFIX
from privacy.keyring import MasterKeyring, generate_keyring, load_keyring, write_secret_file
from privacy.sqlite_storage import SqliteStorage
from privacy.storage import Storage

log = logging.getLogger(__name__)


def open_storage(config: StoreConfig) -> Storage:
    """The backend ``config`` names (no keys involved)."""
    if config.backend == "redis":
        from privacy.redis_storage import RedisStorage  # the Redis client loads only when Redis is configured

        return RedisStorage(config.redis)

    return SqliteStorage(config.sqlite)


def open_store(config: StoreConfig | None = None, env: Mapping[str, str] | None = None) -> HistoryStore:
    """Open the history store: backend, master key (environment, key file, or generated for an empty
    store), and the start-up check that the key is the right one (MasterKeyError if not)."""
    config = config or StoreConfig()
    storage = open_storage(config)
    try:
        keyring = _keyring(config, storage, env)
        return HistoryStore(storage, keyring, config)
    except BaseException:
        storage.close()
        raise


def _keyring(config: StoreConfig, storage: Storage, env: Mapping[str, str] | None) -> MasterKeyring:
    keyring = load_keyring(config.key_file, env, MASTER_KEY_ENV)
    if keyring is not None:
        return keyring
    sealed_with = sorted(int(n[len(CHECK_PREFIX):]) for n in storage.meta_items(CHECK_PREFIX))
    if sealed_with:
        raise MasterKeyError(
            f"no master key: this store is sealed with master key version(s) {sealed_with}; set "
            f"{MASTER_KEY_ENV} or restore the key file {config.key_file}"
        )
    try:
        return generate_keyring(config.key_file)
    except FileExistsError:  # another process generated it first
        keyring = load_keyring(config.key_file, env, MASTER_KEY_ENV)
        assert keyring is not None
        return keyring


def ensure_admin_key(store: HistoryStore, config: StoreConfig | None = None) -> Path | None:
    """On first start (no admin key exists), create one and write it to ``<data_dir>/admin.key`` (0600).

    Returns the file's path when a key was created, else None. Only one of several replicas sharing a
    store creates it. The key is not printed: read the file, store the key elsewhere, delete the file.
    """
    config = config or store.config
    if store.has_admin_key() or not store.storage.meta_put("admin-bootstrap", b"1", only_new=True):
        return None
    issued = store.create_admin_key()
    path = config.directory / "admin.key"
    write_secret_file(path, (issued.secret + "\n").encode(), exclusive=not path.exists())
    os.chmod(path, 0o600)
    log.warning("created the first admin key (id %s) in %s (0600): move it to a secret store", issued.key_id, path)
    return path
