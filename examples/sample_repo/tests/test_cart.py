import pytest

from shop.cart import Cart


def test_subtotal_counts_quantities():
    cart = Cart()
    cart.add("apple", 0.5, quantity=4)
    cart.add("pear", 1.25)
    assert cart.subtotal() == 3.25


def test_discount():
    cart = Cart()
    cart.add("book", 20.0)
    assert cart.total(discount_percent=10) == 18.0


def test_rejects_zero_quantity():
    with pytest.raises(ValueError):
        Cart().add("x", 1.0, quantity=0)
