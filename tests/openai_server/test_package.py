def test_server_package_is_installed_and_importable():
    import quire.openai_server

    assert quire.openai_server.__version__ == "0.1.0"
