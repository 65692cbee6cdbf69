;;;; The request-head reader on its own: finding a head's end in octets,
;;;; the size limits, and the parse into Hunchentoot's request parts.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite request-head :in all :description "Request heads read from octets.")
(in-suite request-head)

(defun head-octets (&rest lines)
  (flex:string-to-octets (apply #'crlf-lines lines) :external-format :latin-1))

(defun scan-head (octets &key (max-header-bytes 16384))
  "SCAN-REQUEST-HEAD's values for the whole of OCTETS, as a list."
  (multiple-value-list
   (hunchentoot-recycling-taskmaster::scan-request-head octets 0 (length octets) max-header-bytes)))

(defun head-parts (head)
  "The headers, method, URI and protocol of the REQUEST-HEAD HEAD, as a list."
  (list (hunchentoot-recycling-taskmaster::request-head-headers head)
        (hunchentoot-recycling-taskmaster::request-head-method head)
        (hunchentoot-recycling-taskmaster::request-head-uri head)
        (hunchentoot-recycling-taskmaster::request-head-protocol head)))

(defun parse-head (&rest lines)
  "The parse of the head made of LINES (a blank line is added), as a list:
headers, method, URI, protocol; or the status code alone."
  (let ((octets (apply #'head-octets (append lines '("")))))
    (destructuring-bind (status &optional request-start request-line-end head-end) (scan-head octets)
      (if (eq status :complete)
          (handler-case (head-parts (hunchentoot-recycling-taskmaster::parse-request-head
                                     octets request-start request-line-end head-end))
            (hunchentoot-recycling-taskmaster::request-head-refused (condition)
              (list (hunchentoot-recycling-taskmaster::refused-status condition))))
          (list status)))))

(defun parse-status (&rest lines)
  "The status code a head of LINES is refused with, or :ACCEPTED."
  (let ((result (apply #'parse-head lines)))
    (if (integerp (first result)) (first result) :accepted)))

(test head.complete-get-is-parsed
  (destructuring-bind (headers method uri protocol)
      (parse-head "GET /a/b?c=d HTTP/1.1" "Host: example.org" "Accept:  text/plain  ")
    (is (equal '((:host . "example.org") (:accept . "text/plain")) headers))
    (is (eq :get method))
    (is (equal "/a/b?c=d" uri))
    (is (eq :http/1.1 protocol))))

(test head.parsed-into-a-reused-head-as-into-a-new-one
  ;; A worker parses every head into its one REQUEST-HEAD: each parse
  ;; leaves nothing of the one before.
  (let ((reused (hunchentoot-recycling-taskmaster::make-request-head)))
    (dolist (lines '(("POST /form HTTP/1.1" "Host: a" "Content-Length: 0" "Cookie: c=1")
                     ("GET / HTTP/1.0")
                     ("DELETE /x?y HTTP/1.1" "Host: b")))
      (let* ((octets (apply #'head-octets (append lines '(""))))
             (parts (destructuring-bind (status start line-end head-end) (scan-head octets)
                      (declare (ignore status))
                      (list start line-end head-end))))
        (flet ((parse (head)
                 (head-parts (apply #'hunchentoot-recycling-taskmaster::parse-request-head
                                    octets (append parts (list nil head))))))
          (is (equal (parse nil) (parse reused)) "~S" (first lines)))))))

(test head.a-host-named-again-is-the-same-string
  ;; A reused head gives the next request naming the same host the same
  ;; string, and a new string for another host.
  (let ((reused (hunchentoot-recycling-taskmaster::make-request-head)))
    (flet ((host (host)
             (let ((octets (head-octets "GET / HTTP/1.1" (format nil "Host: ~A" host) "")))
               (destructuring-bind (status start line-end head-end) (scan-head octets)
                 (declare (ignore status))
                 (cdr (assoc :host (hunchentoot-recycling-taskmaster::request-head-headers
                                    (hunchentoot-recycling-taskmaster::parse-request-head
                                     octets start line-end head-end nil reused))))))))
      (let* ((first (host "example.org"))
             (again (host "example.org"))
             (other (host "example.net"))
             (longer (host "example.org:8080")))
        (is (eq first again))
        (is (equal "example.net" other))
        (is (equal "example.org:8080" longer))
        (is (not (eq longer first)))))))

;; The host a reused head remembers is not checked again: only a string it
;; found valid may be remembered.
(test head.a-reused-head-still-refuses-an-invalid-host
  (let ((reused (hunchentoot-recycling-taskmaster::make-request-head)))
    (flet ((status (&rest lines)
             (let ((octets (apply #'head-octets (append lines (list "")))))
               (destructuring-bind (status start line-end head-end) (scan-head octets)
                 (declare (ignore status))
                 (handler-case (progn (hunchentoot-recycling-taskmaster::parse-request-head
                                       octets start line-end head-end nil reused)
                                      :accepted)
                   (hunchentoot-recycling-taskmaster::request-head-refused (condition)
                     (hunchentoot-recycling-taskmaster::refused-status condition)))))))
      (is (eq :accepted (status "GET / HTTP/1.1" "Host: example.org")))
      (is (eql 400 (status "GET / HTTP/1.1" "Host: exa mple")) "another, invalid host")
      (is (equal "example.org" (hunchentoot-recycling-taskmaster::request-head-host reused))
          "a refused head leaves the valid host remembered")
      (is (eq :accepted (status "GET / HTTP/1.1" "Host: example.org")))
      (is (eql 400 (status "GET http://bad host/ HTTP/1.1" "Host: example.org"))
          "an invalid absolute-form host beside the remembered one")
      (is (eq :accepted (status "GET http://other.example/ HTTP/1.1" "Host: example.org")))
      (is (equal "other.example" (hunchentoot-recycling-taskmaster::request-head-host reused)))
      (is (eql 400 (status "GET / HTTP/1.1" "Host: other.example:x"))))))

(test head.every-proper-prefix-is-incomplete
  (let ((octets (head-octets "GET / HTTP/1.1" "Host: x" "")))
    (is (loop for end from 0 below (length octets)
              always (eq :incomplete
                         (hunchentoot-recycling-taskmaster::scan-request-head octets 0 end 16384))))
    (is (eq :complete (first (scan-head octets))))))

(test head.bare-lf-and-leading-blank-lines-are-accepted
  (let ((octets (flex:string-to-octets (format nil "~%~C~%GET / HTTP/1.0~%Host: x~%~%" #\Return)
                                       :external-format :latin-1)))
    (destructuring-bind (status request-start request-line-end head-end) (scan-head octets)
      (is (eq :complete status))
      (is (= (length octets) head-end))
      (destructuring-bind (headers method uri protocol)
          (head-parts (hunchentoot-recycling-taskmaster::parse-request-head
                       octets request-start request-line-end head-end))
        (is (equal '((:host . "x")) headers))
        (is (eq :get method))
        (is (equal "/" uri))
        (is (eq :http/1.0 protocol))))))

(test head.request-line-limit-is-8-kib
  (flet ((line-of (length)
           (format nil "GET /~A HTTP/1.1" (make-string (- length 14) :initial-element #\a))))
    (is (= 8192 (length (line-of 8192))))
    (is (eq :accepted (parse-status (line-of 8192) "Host: x")))
    (is (eql 414 (parse-status (line-of 8193) "Host: x")))
    (is (eql 414 (first (scan-head (flex:string-to-octets (line-of 9000)))))
        "a request line still arriving is refused once it is too long")))

(test head.header-block-limit-is-configurable
  (let ((big-header (format nil "X-Big: ~A" (make-string 2000 :initial-element #\b))))
    (is (eq :complete (first (scan-head (head-octets "GET / HTTP/1.1" big-header "")))))
    (is (eql 431 (first (scan-head (head-octets "GET / HTTP/1.1" big-header "") :max-header-bytes 1024))))
    (is (eql 431 (first (scan-head (head-octets "GET / HTTP/1.1" big-header) :max-header-bytes 1024)))
        "a header block still arriving is refused once it is too large")
    (is (eql 431 (apply #'parse-status "GET / HTTP/1.1"
                        (loop repeat 9 collect big-header)))
        "the default limit is 16 KiB")))

(test head.at-most-100-header-lines
  (flet ((lines (count) (loop for i below count collect (format nil "X-~D: ~D" i i))))
    (is (eq :accepted (apply #'parse-status "GET / HTTP/1.0" (lines 100))))
    (is (eql 431 (apply #'parse-status "GET / HTTP/1.0" (lines 101))))))

(test head.malformed-heads-are-400
  (dolist (lines `(("GET / HTTP/1.1" "Host x")
                   ("GET / HTTP/1.1" "Host : x")
                   ("GET / HTTP/1.1" ": x")
                   ("GET / HTTP/1.1" "X-A: a" " folded")
                   ("GET / HTTP/1.1" ,(format nil "X-A: a~Cb" (code-char 1)))
                   ("G(ET / HTTP/1.1")
                   ("GET /")
                   ("GET  / HTTP/1.1")
                   (,(format nil "GET /caf~C HTTP/1.1" (code-char 233)))
                   ("GET / FTP/1.1")
                   (" GET / HTTP/1.1")))
    (is (eql 400 (apply #'parse-status lines)) "~S" lines)))

(test head.other-http-versions-are-505
  (is (eql 505 (parse-status "GET / HTTP/2.0")))
  (is (eql 505 (parse-status "GET / HTTP/0.9")))
  (is (eq :accepted (parse-status "GET / HTTP/1.0"))))

(test head.later-http-1-minor-versions-are-read-as-1.1
  ;; RFC 9112 2.3.
  (is (eq :http/1.1 (fourth (parse-head "GET / HTTP/1.2" "Host: x"))))
  (is (eq :http/1.1 (fourth (parse-head "GET / HTTP/1.9" "Host: x")))))

(test head.over-long-methods-are-501
  (is (eql 501 (parse-status (format nil "~A / HTTP/1.1" (make-string 33 :initial-element #\X)) "Host: x")))
  (is (eql 501 (parse-status (format nil "~A / HTTP/1.1" (make-string 1024 :initial-element #\G)) "Host: x")))
  (is (eq :accepted (parse-status (format nil "~A / HTTP/1.1" (make-string 32 :initial-element #\X)) "Host: x")))
  (is (eq :accepted (parse-status "VERSION-CONTROL / HTTP/1.1" "Host: x"))))

(defun expects-continue (&rest lines)
  (let ((octets (apply #'head-octets (append lines '("")))))
    (destructuring-bind (status request-start request-line-end head-end) (scan-head octets)
      (declare (ignore status))
      (and (hunchentoot-recycling-taskmaster::expects-continue-p
            (hunchentoot-recycling-taskmaster::parse-request-head octets request-start request-line-end head-end))
           t))))

(test head.expect-100-continue-only-in-http-1.1
  ;; RFC 9110 10.1.1: a server ignores it in an HTTP/1.0 request.
  (is-true (expects-continue "POST / HTTP/1.1" "Host: x" "Content-Length: 5" "Expect: 100-continue"))
  (is-false (expects-continue "POST / HTTP/1.0" "Content-Length: 5" "Expect: 100-continue"))
  (is-false (expects-continue "POST / HTTP/1.1" "Host: x" "Content-Length: 5")))

(test head.ambiguous-body-length-is-400
  (is (eql 400 (parse-status "POST / HTTP/1.1" "Content-Length: 5" "Transfer-Encoding: chunked")))
  (is (eql 400 (parse-status "POST / HTTP/1.1" "Content-Length: 5" "Content-Length: 6")))
  (is (eql 400 (parse-status "POST / HTTP/1.1" "Content-Length: -5")))
  (is (eql 400 (parse-status "POST / HTTP/1.1" "Content-Length: 5, 5")))
  (is (eql 400 (parse-status "POST / HTTP/1.1" "Host: x" "Transfer-Encoding: gzip")))
  (is (equal '((:content-length . "5"))
             (first (parse-head "POST / HTTP/1.0" "Content-Length: 5" "Content-Length: 5")))
      "a repeated Content-Length that agrees is one header"))

(test head.transfer-codings-follow-rfc-9112
  (is (eq :accepted (parse-status "POST / HTTP/1.1" "Host: x" "Transfer-Encoding: chunked")))
  (is (eq :accepted (parse-status "POST / HTTP/1.1" "Host: x" "Transfer-Encoding: Chunked ")))
  (is (eql 400 (parse-status "POST / HTTP/1.0" "Transfer-Encoding: chunked" "Connection: keep-alive"))
      "HTTP/1.0 with Transfer-Encoding has faulty framing (6.1)")
  (dolist (codings '("identity, chunked" "gzip, chunked" "chunked, chunked" "gzip,chunked"))
    (is (eql 501 (parse-status "POST / HTTP/1.1" "Host: x" (format nil "Transfer-Encoding: ~A" codings)))
        "~A: a coding this server does not decode" codings))
  (is (eql 400 (parse-status "POST / HTTP/1.1" "Host: x" "Transfer-Encoding: chunked, gzip"))
      "chunked not last: the length cannot be known"))

(test head.http-1.1-needs-one-valid-host
  (is (eql 400 (parse-status "GET / HTTP/1.1")) "no Host")
  (is (eql 400 (parse-status "GET / HTTP/1.1" "Host: a" "Host: b")) "two Hosts")
  (is (eql 400 (parse-status "GET / HTTP/1.1" "Host: a" "host: a")) "two Hosts, even equal")
  (dolist (host '("exa mple" "a/b" "a:b" "[::1" "[zz]" "a@b" "\"x\""))
    (is (eql 400 (parse-status "GET / HTTP/1.1" (format nil "Host: ~A" host))) "invalid Host ~S" host))
  (dolist (host '("example.org" "example.org:8080" "127.0.0.1:80" "[::1]:4242" "[::1]" "" "a:" "xn--bcher-kva.example"))
    (is (eq :accepted (parse-status "GET / HTTP/1.1" (format nil "Host: ~A" host))) "valid Host ~S" host))
  (is (eq :accepted (parse-status "GET / HTTP/1.0")) "HTTP/1.0 needs none"))

(test head.absolute-form-target-names-the-host
  (flet ((host-of (&rest lines)
           (cdr (assoc :host (first (apply #'parse-head lines))))))
    (is (equal "other.example" (host-of "GET http://other.example/x HTTP/1.1" "Host: mine.example")))
    (is (equal "other.example:81" (host-of "GET HTTPS://other.example:81?q HTTP/1.1" "Host: mine.example")))
    (is (equal "other.example" (host-of "GET http://other.example HTTP/1.1")) "a Host header is not needed")
    (is (equal "mine.example" (host-of "GET /x HTTP/1.1" "Host: mine.example")) "origin form keeps Host"))
  (is (eql 400 (parse-status "GET http://bad host/ HTTP/1.1" "Host: x"))))

(test head.methods-are-case-sensitive
  (destructuring-bind (headers method uri protocol) (parse-head "get / HTTP/1.1" "Host: x")
    (declare (ignore headers uri protocol))
    (is (not (eq :get method)) "get is not GET (RFC 9110 9.1)")
    (is (string= "get" (symbol-name method))))
  (is (eq :get (second (parse-head "GET / HTTP/1.1" "Host: x")))))

(test head.repeated-headers-are-joined
  (is (equal '((:accept . "a,b") (:host . "x"))
             (first (parse-head "GET / HTTP/1.1" "Accept: a" "Host: x" "accept: b")))))

(test head.values-are-latin-1
  (let ((cafe (format nil "caf~C" (code-char 233))))
    (is (equal `((:x-name . ,cafe))
               (first (parse-head "GET / HTTP/1.0" (format nil "X-Name: ~A" cafe)))))))

(test head.known-names-are-found-in-any-case
  (is (equal '((:user-agent . "w") (:content-type . "t") (:x-forwarded-for . "f") (:host . "x"))
             (first (parse-head "POST / HTTP/1.1" "user-agent: w" "CONTENT-TYPE: t" "X-Forwarded-For: f"
                                "hOsT: x"))))
  (destructuring-bind (headers method &rest rest) (parse-head "DELETE / HTTP/1.1" "Hosu: x" "Host: y")
    (declare (ignore rest))
    (is (eq :delete method))
    (is (string= "HOSU" (symbol-name (car (first headers)))) "a name as long as a known one is not taken for it")
    (is (not (eq :host (car (first headers)))))
    (is (eq :host (car (second headers)))))
  (is (string= "DELETe" (symbol-name (second (parse-head "DELETe / HTTP/1.1" "Host: x"))))
      "a method is found by its exact spelling"))

(test head.made-up-names-are-not-interned
  (let* ((header-name (format nil "X-Made-Up-~36R" (random (expt 2 64))))
         (method-name (format nil "FROB~36R" (random (expt 2 64))))
         (parse (parse-head (format nil "~A / HTTP/1.0" method-name) (format nil "~A: yes" header-name)
                            "Content-Type: text/plain")))
    (destructuring-bind (headers method uri protocol) parse
      (declare (ignore uri protocol))
      (is (null (find-symbol (string-upcase header-name) "KEYWORD")))
      (is (null (find-symbol method-name "KEYWORD")))
      (is (null (symbol-package method)))
      (is (string= method-name (symbol-name method)))
      (is (equal "yes" (cdr (assoc header-name headers :test #'string-equal)))
          "found by its name, as HUNCHENTOOT:HEADER-IN finds a header named by a string")
      (is (eq :content-type (car (second headers))) "known names are keywords"))))

(test head.range-specs-follow-rfc-9110
  (flet ((specs (value) (hunchentoot-recycling-taskmaster::parse-range-specs value)))
    (is (equal '((0 . 4)) (specs "bytes=0-4")))
    (is (equal '((5 . nil) (nil . 3)) (specs "bytes = 5- , -3")) "open, suffix, spaces")
    (is (equal '((0 . 0) (0 . nil)) (specs "bytes=0-0,0-")))
    (dolist (invalid '("bytes=5-2" "lines=1-2" "bytes=" "bytes=0-1,,2-3" "bytes=a-b" "bytes=1" "0-4"
                       "bytes=-" "bytes=1-2-3" "bytes=+1-2"))
      (is (null (specs invalid)) "~S is not a bytes ranges-specifier" invalid)))
  (is (equal '((:host . "x"))
             (first (parse-head "GET / HTTP/1.1" "Host: x" "Range: bytes=5-2")))
      "an invalid Range header is left out of the head")
  (is (equal '((:range . "bytes=2-4") (:host . "x"))
             (sort (copy-list (first (parse-head "GET / HTTP/1.1" "Host: x" "Range: bytes=2-4")))
                   #'string> :key (lambda (entry) (string (car entry)))))))

;;; The Cookie header, read as Hunchentoot's initializer reads it.

(defun hunchentoot-cookie-reading (header)
  "Hunchentoot's reading of the Cookie header HEADER, or :ERROR when it signals one."
  (handler-case (hrt::parse-cookie-header header)
    (error () :error)))

(defparameter *cookie-header-pieces*
  (list "a" "b=1" "hunchentoot-session=12:ab" "x=" "=v" " " "  " (string #\Tab) ";" "," "; " " ;" "=" "c=d=e" "%41" "é=ü")
  "What the random Cookie headers of COOKIE-HEADER.SAME-AS-HUNCHENTOOTS are made of.")

(defun random-cookie-header (random-state)
  (apply #'concatenate 'string
         (loop repeat (random 7 random-state)
               collect (nth (random (length *cookie-header-pieces*) random-state) *cookie-header-pieces*))))

(test cookie-header.same-as-hunchentoots
  "Every header COOKIE-HEADER-FIELDS reads, it reads as Hunchentoot does;
those it leaves to Hunchentoot include every one Hunchentoot refuses."
  (let ((random-state (sb-ext:seed-random-state 52))
        (read 0) (left 0))
    (dolist (header (append (list "" "a=1" "a=1; b=2" "a=1 ,b=2" " a = 1 ; b" "a=1;" "a=1; ;" ";a=1" "a=1;;b=2"
                                  (format nil "a=1;~Cb=2" #\Tab) (format nil "a=1~C;b" #\Return)
                                  (format nil "~Ca=1" #\Tab) "a=1 " ",")
                            (loop repeat 3000 collect (random-cookie-header random-state))))
      (let ((ours (hrt::cookie-header-fields header))
            (theirs (hunchentoot-cookie-reading header)))
        ;; The engine's strings are of either kind; each is read alike.
        (when (every (lambda (char) (typep char 'base-char)) header)
          (is (equal ours (hrt::cookie-header-fields (coerce header 'simple-base-string)))
              "~S read otherwise as a base string" header))
        (if (eq ours :irregular)
            (incf left)
            (progn (incf read)
                   (is (equal theirs ours) "~S: Hunchentoot ~S, ours ~S" header theirs ours)))
        (when (eq theirs :error)
          (is (eq :irregular ours) "~S: Hunchentoot refuses it, ours read ~S" header ours))))
    ;; Most headers are read here, not left to Hunchentoot.
    (is (> read (* 2 left)) "~D read, ~D left to Hunchentoot" read left)))

(test string-occurs-p.as-search-finds-it
  "STRING-OCCURS-P answers as SEARCH of two strings, over either kind of
string searched, the part at its start, its end, overlapping itself,
longer than the string, and empty."
  (let ((random-state (sb-ext:seed-random-state 55)))
    (flet ((check (part string)
             (dolist (string (list string (coerce string 'simple-base-string)))
               (is (eq (and (search part string) t) (hrt::string-occurs-p part string))
                   "~S in ~S" part string))))
      (dolist (case '(("" "") ("" "abc") ("a" "") ("abc" "ab") ("ab" "ab") ("ab" "xab") ("ab" "abx")
                      ("aab" "aaab") ("hunchentoot-session" "x=1; hunchentoot-session=12:ab")
                      ("hunchentoot-session" "hunchentoot-sessio")))
        (apply #'check case))
      (loop repeat 2000
            do (flet ((random-text (most)
                        (coerce (loop repeat (random most random-state) collect (char "ab=;" (random 4 random-state)))
                                'string)))
                 (check (random-text 4) (random-text 12)))))))

(test octets-input-stream.reads-its-octets-as-a-file-would
  "An OCTETS-INPUT-STREAM reads the octets of its vector from START below
END, by the octet, by sequence and through a flexi-stream, and positions
count from START."
  (let* ((octets (map 'hrt::octets #'char-code "xxhello, worldyy"))
         (stream (hrt::make-octets-input-stream octets :start 2 :end 14)))
    (is (equal '(unsigned-byte 8) (stream-element-type stream)))
    (is (= (char-code #\h) (read-byte stream)))
    (is (= 1 (file-position stream)))
    (let ((into (make-array 8 :element-type '(unsigned-byte 8) :initial-element 0)))
      (is (= 8 (read-sequence into stream :start 2)))
      (is (equal "ello, " (map 'string #'code-char (subseq into 2)))))
    (is (listen stream))
    (let ((rest (make-array 10 :element-type '(unsigned-byte 8))))
      (is (= 5 (read-sequence rest stream)))
      (is (equal "world" (map 'string #'code-char (subseq rest 0 5)))))
    (is (not (listen stream)))
    (is (eq :end (read-byte stream nil :end)))
    (is (file-position stream 0))
    (is (equal "hello, world" (read-line (flex:make-flexi-stream stream :external-format :latin-1))))
    (is (not (file-position stream 13)))
    (is (file-position stream :end))
    (is (= 12 (file-position stream)))))

(test form-body.fields-as-hunchentoot-reads-them
  "FORM-FIELDS reads what Hunchentoot's reading reads the same, and leaves
the rest to it; a body of trailing &s ends at the first."
  (flet ((fields (body) (hrt::form-fields (map 'hrt::octets #'char-code body))))
    (is (equal '(("a" . "1") ("b" . " x ") ("c" . "") ("n" . " v ") ("d" . "e=f"))
               (fields "a=1&b=+x+&c& n = v &d=e=f&&")))
    (is (equal '() (fields "")))
    (is (equal '(("" . "v") ("a" . "")) (fields "=v&a=")))
    (is (equal '(("a" . "A") ("e" . "ada@x.org") ("m" . "a, b%")) (fields "a=%41&e=ada%40x.org&m=a%2C+b%25")))
    (dolist (irregular (list "&a=1" "a=1&&b=2" "a=%E9" "a=%zz" "a=%4" "a=%u0041" (format nil "a=caf~C" (code-char 233))))
      (is (eq :irregular (fields irregular)) "~S" irregular))
    (is (equal '(("a" . "1")) (fields (concatenate 'string "a=1" (make-string 100000 :initial-element #\&)))))))
