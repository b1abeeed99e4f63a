package main

import (
	"fmt"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// days is a count of days at the start of an age, as in 1d or 2d12h.
var days = regexp.MustCompile(`^(\d+)d(.*)$`)

// parseAge reads a positive age as a Go duration (90m, 36h) or as days
// (1d, 7d), which may go on with a Go duration (1d12h).
func parseAge(s string) (time.Duration, error) {
	var d time.Duration
	rest := s
	if m := days.FindStringSubmatch(s); m != nil {
		n, err := strconv.Atoi(m[1])
		if err != nil || n > 100000 {
			return 0, fmt.Errorf("%q has too many days", s)
		}
		d, rest = time.Duration(n)*24*time.Hour, m[2]
	}
	if rest != "" || d == 0 {
		more, err := time.ParseDuration(rest)
		if err != nil {
			return 0, fmt.Errorf("%q is not an age such as 90m, 36h or 7d", s)
		}
		d += more
	}
	if d <= 0 {
		return 0, fmt.Errorf("%q is not a positive age", s)
	}
	return d, nil
}

// ageFlag is a flag holding an age that parseAge reads; zero when unset.
type ageFlag time.Duration

func (a *ageFlag) String() string {
	if *a == 0 {
		return ""
	}
	return time.Duration(*a).String()
}

func (a *ageFlag) Set(s string) error {
	d, err := parseAge(s)
	if err != nil {
		return err
	}
	*a = ageFlag(d)
	return nil
}

func (a *ageFlag) Type() string { return "age" }

// parseBefore reads a time as RFC 3339, or as an age before now (see
// parseAge).
func parseBefore(s string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	if d, err := parseAge(s); err == nil {
		return now.Add(-d), nil
	}
	return time.Time{}, fmt.Errorf("%q is neither an RFC 3339 time nor an age such as 2h or 7d", s)
}

// mysqlDSN turns what follows mysql:// into a DSN of the MySQL driver: a
// DSN already (user:pass@tcp(host:3306)/db) is kept as it is; a URL's
// rest (user:pass@host:port/db?params) becomes
// user:pass@tcp(host:port)/db?params, port 3306 when it names none.
func mysqlDSN(rest string) (string, error) {
	if strings.Contains(rest, "(") {
		return rest, nil
	}
	u, err := url.Parse("mysql://" + rest)
	if err != nil {
		return "", fmt.Errorf("--db: not a MySQL URL (mysql://user:pass@host:3306/db): %w", err)
	}
	if u.Host == "" {
		return "", fmt.Errorf("--db: mysql://%s names no host, as in mysql://user:pass@host:3306/db", rest)
	}
	host := u.Host
	if u.Port() == "" {
		host += ":3306"
	}
	var b strings.Builder
	if u.User != nil {
		b.WriteString(u.User.Username())
		if pass, ok := u.User.Password(); ok {
			b.WriteString(":" + pass)
		}
		b.WriteString("@")
	}
	b.WriteString("tcp(" + host + ")/" + strings.TrimPrefix(u.Path, "/"))
	if u.RawQuery != "" {
		b.WriteString("?" + u.RawQuery)
	}
	return b.String(), nil
}

// postgresKeys are the keys of a key=value PostgreSQL DSN (as GORM's docs
// write it: host=localhost user=gorm password=gorm dbname=gorm port=9920
// sslmode=disable) that tell it from other text.
var postgresKeys = map[string]bool{"host": true, "hostaddr": true, "dbname": true, "user": true, "port": true}

// keyValueDSN reports whether s is a key=value PostgreSQL DSN: a libpq
// connection string (see parseConninfo) with one of the PostgreSQL keys.
func keyValueDSN(s string) bool {
	settings, err := parseConninfo(s)
	if err != nil {
		return false
	}
	for k := range settings {
		if postgresKeys[k] {
			return true
		}
	}
	return false
}

// parseConninfo reads s as libpq reads a connection string: pairs
// key = value separated by whitespace, with optional whitespace around the
// =. A value is either a run of characters other than whitespace, or
// enclosed in single quotes, which may hold whitespace; in both, a
// backslash stands for the character after it (\' a quote, \\ a
// backslash). A key is letters, digits and underscores. It fails on
// anything else, such as a URL, a key without =, or an unterminated quote.
func parseConninfo(s string) (map[string]string, error) {
	settings := map[string]string{}
	i := 0
	skipSpace := func() {
		for i < len(s) && isConninfoSpace(s[i]) {
			i++
		}
	}
	for {
		skipSpace()
		if i == len(s) {
			return settings, nil
		}
		start := i
		for i < len(s) && s[i] != '=' && !isConninfoSpace(s[i]) {
			i++
		}
		key := s[start:i]
		if !conninfoKey(key) {
			return nil, fmt.Errorf("%q is not a connection parameter name", key)
		}
		skipSpace()
		if i == len(s) || s[i] != '=' {
			return nil, fmt.Errorf("no = after %q", key)
		}
		i++
		skipSpace()
		quoted := i < len(s) && s[i] == '\''
		if quoted {
			i++
		}
		var val strings.Builder
		for {
			if i == len(s) {
				if quoted {
					return nil, fmt.Errorf("the value of %q has no closing quote", key)
				}
				break
			}
			c := s[i]
			if quoted && c == '\'' {
				i++
				break
			}
			if !quoted && isConninfoSpace(c) {
				break
			}
			if c == '\\' {
				i++
				if i == len(s) {
					continue // as libpq, a final backslash stands for nothing
				}
				c = s[i]
			}
			val.WriteByte(c)
			i++
		}
		settings[key] = val.String()
	}
}

// conninfoKey reports whether k can name a libpq connection parameter.
func conninfoKey(k string) bool {
	if k == "" {
		return false
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

// isConninfoSpace reports whether c is whitespace to libpq.
func isConninfoSpace(c byte) bool {
	return strings.IndexByte(" \t\n\r\v\f", c) >= 0
}
