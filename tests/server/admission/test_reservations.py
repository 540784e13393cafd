"""The reservation book on its own: booking, claiming on time, early and late, and expiry."""


from embedserve.admission.reservations import EARLY_S, GRACE_OF_WAIT, GRACE_S, ReservationBook


def test_a_retry_on_time_claims_its_room_once():
    book = ReservationBook()
    book.book(key=7, tokens=100, now=10.0, wait_s=2.0)
    assert book.reserved_tokens == 100
    assert book.claim(7, 12.0 - EARLY_S / 2)  # within the early tolerance
    assert book.reserved_tokens == 0
    assert not book.claim(7, 12.0)  # consumed: a second copy is a new request


def test_the_same_texts_arriving_early_are_another_caller_and_leave_the_booking_alone():
    book = ReservationBook()
    book.book(7, 100, 10.0, 2.0)
    assert not book.claim(7, 11.5)
    assert book.reserved_tokens == 100
    assert book.claim(7, 12.0)


def test_an_unknown_request_has_no_booking():
    book = ReservationBook()
    book.book(7, 100, 10.0, 2.0)
    assert not book.claim(8, 12.0)


def test_bookings_nobody_claims_expire_and_free_their_room():
    book = ReservationBook()
    book.book(1, 100, 0.0, 1.0)
    book.book(2, 50, 0.0, 8.0)
    late = 1.0 + GRACE_S + GRACE_OF_WAIT * 1.0
    book.expire(late - 0.01)
    assert book.reserved_tokens == 150
    book.expire(late + 0.01)
    assert book.reserved_tokens == 50 and book.expired_tokens == 100
    assert not book.claim(1, late + 0.01)
    assert book.claim(2, 8.1)
    book.expire(100.0)  # the claimed booking's expiry passes: nothing is freed twice
    assert book.reserved_tokens == 0 and book.expired_tokens == 100 and len(book) == 0


def test_identical_requests_keep_one_booking_each_in_order():
    book = ReservationBook()
    book.book(7, 100, 0.0, 1.0)
    book.book(7, 100, 0.0, 3.0)
    assert book.claim(7, 1.0)
    assert not book.claim(7, 1.0)  # the second is not due yet
    assert book.claim(7, 3.0)
    assert book.reserved_tokens == 0


def test_nothing_booked_reads_exactly_zero():
    """Bookings are estimates (floats): taken in another order than booked, their sum leaves a
    residue, and /metrics would show room reserved for nobody."""
    book = ReservationBook()
    bookings = [book.book(k, tokens, 0.0, 1.0) for k, tokens in enumerate((0.1, 0.2, 0.7, 1e6 / 3))]
    for b in reversed(bookings):
        book.take(b)
    assert book.reserved_tokens == 0.0
