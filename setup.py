"""Packaging that pyproject.toml cannot say: ship web/ inside the package as ``rtts/web``.

web/ stays where it is (it is also the npm package ``rtts-client``); the wheel maps it to
the ``rtts.web`` resource directory, which the server finds through importlib.resources
(``rtts.config.packaged_web_dir``). Only what a page needs goes in: the HTML, the JS modules,
the CSS and the generated type declarations -- not web/test/, package*.json, node_modules or
dotfiles (MANIFEST.in keeps the sdist to the same files, so a wheel built from it is equal).
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["rtts", "rtts.*"]), "rtts.web", "rtts.web.types"],
    package_dir={"rtts.web": "web"},  # and so rtts.web.types is web/types
    package_data={"rtts": ["py.typed"],
                  "rtts.web": ["index.html", "*.js", "*.css"],
                  "rtts.web.types": ["*.d.ts"]},
)
