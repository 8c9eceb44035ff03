import importlib.metadata


def test_cli_package_is_installed_and_importable():
    import quire.cli  # noqa: F401

    assert importlib.metadata.version("quire-cli") == "0.1.0"
