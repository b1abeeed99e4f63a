package outboxui_test

import (
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/outboxui"
)

func TestWithoutAuthenticationEveryRequestIsRefused(t *testing.T) {
	t.Parallel()
	s := newSite(t, outboxtest.SQLite, outboxui.WithRefresh(outboxui.DefaultRefresh))
	for _, path := range []string{"", "dead", "static/app.css", "login"} {
		code, body := s.do(t, "GET", path, token, nil)
		if code != http.StatusUnauthorized || !strings.Contains(body, "no authentication configured") {
			t.Fatalf("GET %s: %d %q", path, code, body)
		}
	}
}

func TestAnInvalidOptionRefusesEveryRequestNamingIt(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		opt  outboxui.Option
		want string
	}{
		{outboxui.WithToken("short"), "WithToken"},
		{outboxui.WithAuth(nil), "WithAuth"},
		{outboxui.WithRefresh(0), "WithRefresh"},
	} {
		s := newSite(t, outboxtest.SQLite, outboxui.WithToken(token), tc.opt)
		if code, body := s.do(t, "GET", "", token, nil); code != http.StatusUnauthorized || !strings.Contains(body, tc.want) {
			t.Fatalf("%s: %d %q", tc.want, code, body)
		}
	}
}

func TestARequestWithoutTheTokenGets401(t *testing.T) {
	t.Parallel()
	s := newSite(t, outboxtest.SQLite)
	for _, bearer := range []string{"", "wrong-token-0123456789"} {
		if code, body := s.do(t, "GET", "", bearer, nil); code != http.StatusUnauthorized || !strings.Contains(body, "not authorized") {
			t.Fatalf("bearer %q: %d %q", bearer, code, body)
		}
	}
	if code, body := s.do(t, "GET", "", "", nil, "Accept", "text/html"); code != http.StatusUnauthorized || !strings.Contains(body, `name="token"`) {
		t.Fatalf("a browser without a session: %d, want 401 with the login form:\n%s", code, body)
	}
	if code, _ := s.do(t, "GET", "", token, nil); code != http.StatusOK {
		t.Fatalf("with the bearer token: %d", code)
	}
}

func TestTheLoginFormSetsASessionCookie(t *testing.T) {
	t.Parallel()
	s := newSite(t, outboxtest.SQLite)
	form := func(tok string) *strings.Reader { return strings.NewReader(url.Values{"token": {tok}}.Encode()) }
	ct := "application/x-www-form-urlencoded"
	if code, _ := s.do(t, "POST", "login", "", form("wrong"), "Content-Type", ct); code != http.StatusUnauthorized {
		t.Fatalf("login with a wrong token: %d", code)
	}
	req, _ := http.NewRequest("POST", s.url("login"), form(token))
	req.Header.Set("Content-Type", ct)
	res, err := (&http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	var session *http.Cookie
	for _, c := range res.Cookies() {
		if c.Name == outboxui.CookieName {
			session = c
		}
	}
	if res.StatusCode != http.StatusSeeOther || session == nil || !session.HttpOnly || session.SameSite != http.SameSiteStrictMode || strings.Contains(session.Value, token) {
		t.Fatalf("login: %d, cookie %+v", res.StatusCode, session)
	}
	if code, _ := s.do(t, "GET", "dead", "", nil, "Cookie", session.Name+"="+session.Value); code != http.StatusOK {
		t.Fatalf("with the session cookie: %d", code)
	}
}

func TestWithAuthDecidesWhoIsLetIn(t *testing.T) {
	t.Parallel()
	s := newSite(t, outboxtest.SQLite, outboxui.WithAuth(func(r *http.Request) bool { return r.Header.Get("X-User") == "ops" }))
	if code, _ := s.do(t, "GET", "", "", nil, "X-User", "ops"); code != http.StatusOK {
		t.Fatalf("allowed request: %d", code)
	}
	if code, _ := s.do(t, "GET", "", "", nil, "X-User", "guest"); code != http.StatusUnauthorized {
		t.Fatalf("refused request: %d", code)
	}
}

func TestACrossOriginPostIsRefused(t *testing.T) {
	t.Parallel()
	s := newSite(t, outboxtest.SQLite)
	s.publish(t, outbox.Event{ID: "e1", Type: "t", AggregateType: "a", AggregateID: "1"})
	s.fail(t, "e1")
	body := strings.NewReader(url.Values{"one": {"e1"}}.Encode())
	code, _ := s.do(t, "POST", "requeue", token, body, "Content-Type", "application/x-www-form-urlencoded", "Sec-Fetch-Site", "cross-site")
	if code != http.StatusForbidden || s.state(t, "e1") != outbox.StateFailed {
		t.Fatalf("cross-site requeue: %d, state %s", code, s.state(t, "e1"))
	}
	body = strings.NewReader(url.Values{"id": {"e1"}, "confirm": {"yes"}}.Encode())
	code, _ = s.do(t, "POST", "discard", token, body, "Content-Type", "application/x-www-form-urlencoded", "Sec-Fetch-Site", "cross-site")
	if code != http.StatusForbidden || s.state(t, "e1") != outbox.StateFailed {
		t.Fatalf("cross-site discard: %d, state %s", code, s.state(t, "e1"))
	}
}

func TestDiscardAsksToConfirmThenTakesTheDeadLettersOutOfDelivery(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		s := newSite(t, e)
		for _, id := range []string{"d1", "d2", "p1"} {
			s.publish(t, outbox.Event{ID: id, Type: "t", AggregateType: "a", AggregateID: id})
		}
		s.fail(t, "d1", "d2")
		post := func(v url.Values) (int, string) {
			return s.do(t, "POST", "discard", token, strings.NewReader(v.Encode()), "Content-Type", "application/x-www-form-urlencoded", "Sec-Fetch-Site", "same-origin")
		}
		// First the confirmation, of the dead letters only; nothing changes.
		code, body := post(url.Values{"id": {"d1", "p1"}})
		if code != http.StatusOK {
			t.Fatalf("discard without confirm: %d", code)
		}
		mustContain(t, "the confirmation", body, `id="confirm-d1"`, `name="confirm" value="yes"`, "never be delivered", "outbox_records_discarded")
		if strings.Contains(body, `id="confirm-p1"`) {
			t.Fatalf("the confirmation lists p1, which is not a dead letter:\n%s", body)
		}
		if s.state(t, "d1") != outbox.StateFailed {
			t.Fatal("asking for the confirmation discarded d1")
		}
		// Then the discard, of the dead letters only.
		code, _ = post(url.Values{"id": {"d1", "p1"}, "confirm": {"yes"}})
		if code != http.StatusSeeOther {
			t.Fatalf("discard with confirm: %d", code)
		}
		if s.state(t, "d1") != "" || s.state(t, "d2") != outbox.StateFailed || s.state(t, "p1") != outbox.StatePending {
			t.Fatalf("after discarding d1: d1 %q, d2 %q, p1 %q", s.state(t, "d1"), s.state(t, "d2"), s.state(t, "p1"))
		}
		_, body = s.do(t, "GET", "dead?discarded=1", token, nil)
		mustContain(t, "the dead letters after the discard", body, "Discarded 1 message(s)", `id="row-d2"`)
		if strings.Contains(body, `id="row-d1"`) {
			t.Fatalf("d1 is still among the dead letters:\n%s", body)
		}
	})
}

func TestRequeueMovesTheDeadLettersAFormNames(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		s := newSite(t, e)
		for _, id := range []string{"d1", "d2", "d3"} {
			s.publish(t, outbox.Event{ID: id, Type: "t", AggregateType: "a", AggregateID: id})
		}
		s.fail(t, "d1", "d2", "d3")
		post := func(v url.Values) (int, string) {
			return s.do(t, "POST", "requeue", token, strings.NewReader(v.Encode()), "Content-Type", "application/x-www-form-urlencoded", "Sec-Fetch-Site", "same-origin")
		}
		if code, _ := post(url.Values{"one": {"d1"}, "id": {"d2"}}); code != http.StatusSeeOther {
			t.Fatalf("requeue one: %d", code)
		}
		if s.state(t, "d1") != outbox.StatePending || s.state(t, "d2") != outbox.StateFailed {
			t.Fatal("a row's button moved other than its row")
		}
		post(url.Values{"id": {"d2", "d3"}})
		if s.state(t, "d2") != outbox.StatePending || s.state(t, "d3") != outbox.StatePending {
			t.Fatal("the selection was not requeued")
		}
	})
}

func TestAPayloadWithMarkupIsShownAsText(t *testing.T) {
	t.Parallel()
	s := newSite(t, outboxtest.SQLite)
	s.publish(t, outbox.Event{ID: "x1", Type: "<b>type</b>", AggregateType: "a", AggregateID: "1",
		Payload: map[string]string{"html": "<script>alert(1)</script>"}, Headers: map[string]string{"h": "<img src=x>"}})
	code, body := s.do(t, "GET", "message?id=x1", token, nil)
	if code != http.StatusOK || strings.Contains(body, "<script>alert") || strings.Contains(body, "<img src=x>") || strings.Contains(body, "<b>type") {
		t.Fatalf("%d, markup from the row reached the page unescaped:\n%s", code, body)
	}
	mustContain(t, "message page", body, `&lt;b&gt;type&lt;/b&gt;`, `&lt;img src=x&gt;`, `&lt;script&gt;alert(1)&lt;/script&gt;`)
}

func TestTheMessagePageSaysWhatHoldsItBack(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		s := newSite(t, e)
		for _, id := range []string{"s1", "s2", "s3"} {
			s.publish(t, outbox.Event{ID: id, Type: "t", AggregateType: "order", AggregateID: "7"})
		}
		s.fail(t, "s1")
		_, body := s.do(t, "GET", "message?id=s3", token, nil)
		mustContain(t, "message s3", body, "Held back: sequence 1 of this aggregate", "a dead letter", "broker said no", `href="message?id=s1"`, `href="message?id=s2"`)
		_, body = s.do(t, "GET", "message?id=s1", token, nil)
		mustContain(t, "message s1", body, "Dead-lettered after 10 attempt(s)", `name="one" value="s1"`)
		if code, body := s.do(t, "GET", "message?id=nope", token, nil); code != http.StatusNotFound || !strings.Contains(body, "not found") {
			t.Fatalf("unknown event: %d", code)
		}
	})
}

func TestSearchFindsAnEventOrAnAggregate(t *testing.T) {
	t.Parallel()
	s := newSite(t, outboxtest.SQLite)
	s.publish(t, outbox.Event{ID: "q1", Type: "t", AggregateType: "order", AggregateID: "7"},
		outbox.Event{ID: "q2", Type: "t", AggregateType: "user", AggregateID: "7"})
	if code, _ := s.do(t, "GET", "search?q=q1", token, nil); code != http.StatusSeeOther {
		t.Fatalf("search by event id: %d, want a redirect to its page", code)
	}
	_, body := s.do(t, "GET", "search?q=7", token, nil)
	mustContain(t, "search 7", body, "q1", "q2")
	_, body = s.do(t, "GET", "search?q=order/7", token, nil)
	if !strings.Contains(body, "q1") || strings.Contains(body, "q2") {
		t.Fatalf("search order/7:\n%s", body)
	}
}

func TestTheOverviewPanelRefreshesAlone(t *testing.T) {
	t.Parallel()
	s := newSite(t, outboxtest.SQLite)
	s.publish(t, outbox.Event{ID: "r1", Type: "t", AggregateType: "a", AggregateID: "1"})
	code, body := s.do(t, "GET", "?partial=1", token, nil)
	if code != http.StatusOK || strings.Contains(body, "<html") || !strings.Contains(body, `id="count-pending">1<`) {
		t.Fatalf("partial overview: %d\n%s", code, body)
	}
}
