// Package outboxui is a web dashboard for an outbox table, to mount in
// your own server:
//
//	mux.Handle("/outbox/", http.StripPrefix("/outbox", outboxui.Handler(d, outboxui.WithToken(token))))
//
// It shows what a person on call needs: the counts by state, how long the
// oldest due message has waited and a chart of the last hour's deliveries
// and failures (the overview refreshes itself every few seconds); the
// dead letters, with requeue and discard buttons per row and for a
// selection (a discard shows the messages it will take and asks to
// confirm first); one
// message whole, with its aggregate's neighbours in sequence order and,
// when it waits, what holds it back and why; and a search by event id or
// aggregate. It reads through [outboxinspect] and
// [outbox.Dispatcher.Stats], and
// changes nothing but what [outbox.Dispatcher.Requeue] and
// [outbox.Dispatcher.Discard] change. It never runs the dispatcher.
//
// # Authentication cannot be forgotten
//
// A handler made without [WithAuth] or [WithToken] answers every request
// with 401 Unauthorized and a body saying that no authentication was
// configured. With WithToken, a request is let in when it carries
// "Authorization: Bearer <token>", or the session cookie that the login
// page (the form shown with any 401 to a browser) sets after the token
// was typed in. With WithAuth, your function decides.
//
// # Safety
//
// Pages are rendered on the server with html/template, so every value
// shown (payloads, headers, errors) is escaped: a payload containing
// <script> shows as text. The stylesheet and the few lines of script (the
// refresh) are embedded in the binary; a Content-Security-Policy tells
// the browser to load nothing from another host and to run no inline
// script. Requests that change state (requeue, discard, login) are POSTs, and
// cross-origin POSTs are refused ([net/http.CrossOriginProtection]: the
// browser's Sec-Fetch-Site or Origin header must show the same origin).
package outboxui
