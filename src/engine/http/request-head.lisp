;;;; Reading a request head straight from an octet buffer: finding its end,
;;;; enforcing the size limits, and parsing it into what Hunchentoot's
;;;; request object is made of.  No stream is involved, so a head that has
;;;; only partly arrived costs no thread: its bytes wait with the parked
;;;; connection.  Pure functions of the buffer, tested without a socket
;;;; (test/request-head.lisp).

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +max-request-line-bytes+ 8192
  "The longest request line answered; a longer one gets 414.")

(defconstant +max-header-lines+ 100
  "The most header lines in one request head; more get 431.")

(defconstant +cr+ 13)

(defconstant +lf+ 10)

(deftype octets () '(simple-array (unsigned-byte 8) (*)))

;;; Finding the end of a head.

(defun blank-line-p (buffer line-start line-end)
  "True when the line from LINE-START to the LF at LINE-END is empty, with or
without its CR."
  (declare (type octets buffer) (type fixnum line-start line-end))
  (or (= line-start line-end)
      (and (= (1+ line-start) line-end) (= (aref buffer line-start) +cr+))))

(defun skip-blank-lines (buffer start end)
  "RFC 9112 2.2: a server ignores empty lines before a request line (some
clients send CRLF after a request body).  The index of the first byte that
is not part of such a line."
  (declare (type octets buffer) (type fixnum start end))
  (loop while (and (< start end)
                   (or (= (aref buffer start) +lf+)
                       (and (= (aref buffer start) +cr+)
                            (< (1+ start) end)
                            (= (aref buffer (1+ start)) +lf+))))
        do (incf start (if (= (aref buffer start) +lf+) 1 2)))
  start)

(defun scan-request-head (buffer start end max-header-bytes)
  "Look for a complete request head in BUFFER from START below END.  Returns
:INCOMPLETE; or :COMPLETE, the index where the request line starts (after
blank lines), the index of the request line's LF, and the index just past
the head; or the status code that the head already deserves: 414 (request
line too long), 431 (too many header lines, or header block over
MAX-HEADER-BYTES)."
  (declare (type octets buffer) (type fixnum start end max-header-bytes))
  (let* ((line-start (skip-blank-lines buffer start end))
         (request-start line-start)
         (request-line-end nil)
         (header-lines 0))
    (declare (type fixnum line-start header-lines))
    (loop for position of-type fixnum from line-start below end
          when (= (aref buffer position) +lf+)
            do (cond ((null request-line-end)
                      (when (> (- position request-start) (1+ +max-request-line-bytes+))
                        (return-from scan-request-head 414))
                      (setf request-line-end position))
                     ((blank-line-p buffer line-start position)
                      (when (> (- (1+ position) (1+ request-line-end)) max-header-bytes)
                        (return-from scan-request-head 431))
                      (return-from scan-request-head
                        (values :complete request-start request-line-end (1+ position))))
                     ((> (incf header-lines) +max-header-lines+)
                      (return-from scan-request-head 431)))
               (setf line-start (1+ position)))
    (cond ((null request-line-end)
           (if (> (- end request-start) (1+ +max-request-line-bytes+)) 414 :incomplete))
          ((> (- end (1+ request-line-end)) max-header-bytes) 431)
          (t :incomplete))))

;;; Parsing a complete head.

(define-condition request-head-refused (error)
  ((status :initarg :status :reader refused-status
           :documentation "The status code the head is answered with: 400, 501 or 505.")
   (http-p :initarg :http-p :initform t :reader refused-head-http-p
           :documentation "False when its request line names no HTTP version at all."))
  (:report (lambda (condition stream)
             (format stream "The request head is refused with status ~D."
                         (refused-status condition))))
  (:documentation "Signalled by PARSE-REQUEST-HEAD for a head that is answered
with an error reply instead of reaching a handler."))

(defun refuse-head (status)
  (error 'request-head-refused :status status))

(declaim (inline token-octet-p field-octet-p))
(defun token-octet-p (octet)
  "RFC 9110 tchar: the octets of a method or a header name."
  (declare (type (unsigned-byte 8) octet))
  (or (<= 48 octet 57) (<= 65 octet 90) (<= 97 octet 122)
      (find octet #.(map '(simple-array (unsigned-byte 8) (*)) #'char-code "!#$%&'*+-.^_`|~"))))

(defun field-octet-p (octet)
  "Octets allowed in a header value: visible characters, space, tab, obs-text."
  (declare (type (unsigned-byte 8) octet))
  (or (= octet 9) (<= 32 octet 126) (<= 128 octet)))

(defun octets-to-string (buffer start end)
  "The Latin-1 string of BUFFER from START below END, as Hunchentoot decodes heads."
  (declare (type octets buffer) (type fixnum start end))
  (let ((string (make-string (- end start))))
    (loop for index from start below end
          for position from 0
          do (setf (schar string position) (code-char (aref buffer index))))
    string))

(defun octets-spell-p (buffer start end string)
  "True when the octets of BUFFER from START below END are the codes of
the characters of STRING, a simple string."
  (declare (type octets buffer) (type fixnum start end) (type simple-string string))
  (and (= (- end start) (length string))
       (loop for index of-type fixnum from start below end
             for position of-type fixnum from 0
             always (= (aref buffer index) (char-code (schar string position))))))

(declaim (inline octet-position))
(defun octet-position (octet buffer start end)
  "The index of the first OCTET in BUFFER from START below END, or NIL: a
loop the compiler open-codes, where POSITION called a generic search with
EQL (5% of a 0 ms request)."
  (declare (type (unsigned-byte 8) octet) (type octets buffer) (type fixnum start end))
  (loop for index of-type fixnum from start below end
        when (= (aref buffer index) octet) return index))

(defun make-name-scratch ()
  "A string for HEAD-SYMBOL to spell names in, reused from name to name, so
that a name that is a keyword costs no allocation: each worker keeps one."
  (make-array 64 :element-type 'base-char :fill-pointer 0 :adjustable t))

(defun name-scratch (scratch length)
  "SCRATCH (from MAKE-NAME-SCRATCH) made LENGTH characters long, or a fresh
base string when SCRATCH is NIL."
  (if scratch
      (progn (when (< (array-dimension scratch 0) length)
               (adjust-array scratch length))
             (setf (fill-pointer scratch) length)
             scratch)
      (make-string length :element-type 'base-char)))

(defun head-symbol (buffer start end scratch &key (upcase t))
  "The keyword naming the token in BUFFER from START below END (upcased when
UPCASE, as Hunchentoot names header names), spelled in SCRATCH (see
NAME-SCRATCH), if that keyword exists; else an
uninterned symbol of the same name.  Interning every name a client makes up
would grow the keyword package without bound (Hunchentoot issue #24);
HUNCHENTOOT:HEADER-IN still finds an uninterned name when given a string,
and a keyword exists for every name that code mentions."
  (declare (type octets buffer) (type fixnum start end))
  (or (known-name buffer start end (if upcase *known-header-names* *known-methods*) upcase)
      (let ((name (name-scratch scratch (- end start))))
        (loop for index from start below end
              for position from 0
              do (setf (char name position) (let ((char (code-char (aref buffer index))))
                                              (if upcase (char-upcase char) char))))
        (or (find-symbol name "KEYWORD") (make-symbol (coerce name 'simple-base-string))))))

(defun line-end-before-lf (buffer line-start lf-position)
  "The end of the line whose LF is at LF-POSITION, without its CR."
  (declare (type octets buffer) (type fixnum line-start lf-position))
  (if (and (> lf-position line-start) (= (aref buffer (1- lf-position)) +cr+))
      (1- lf-position)
      lf-position))

(defun trim-field (buffer start end)
  "START and END of the field from START below END without surrounding spaces and tabs."
  (declare (type octets buffer) (type fixnum start end))
  (flet ((blank-p (octet) (or (= octet 9) (= octet 32))))
    (loop while (and (< start end) (blank-p (aref buffer start))) do (incf start))
    (loop while (and (< start end) (blank-p (aref buffer (1- end)))) do (decf end)))
  (values start end))

(defun parse-protocol (buffer start end)
  ":HTTP/1.1 or :HTTP/1.0; a later HTTP/1 minor version is read as 1.1, as
RFC 9112 2.3 asks (a recipient processes it as the highest minor version it
conforms to); refuses another major version with 505, anything else with
400."
  (declare (type octets buffer) (type fixnum start end))
  (flet ((digit-at (offset)
           (let ((octet (aref buffer (+ start offset))))
             (and (<= 48 octet 57) (- octet 48)))))
    (let ((http-p (and (>= (- end start) 5)
                       (loop for octet across #.(map 'vector #'char-code "HTTP/")
                             for index from start
                             always (= octet (aref buffer index))))))
      (if (and http-p (= (- end start) 8) (digit-at 5) (= (aref buffer (+ start 6)) 46) (digit-at 7))
          (cond ((/= 1 (digit-at 5)) (refuse-head 505))
                ((= 0 (digit-at 7)) :http/1.0)
                (t :http/1.1))
          (error 'request-head-refused :status 400 :http-p http-p)))))

(defconstant +max-method-octets+ 32
  "The longest method taken; a longer one is none this server implements
(the longest registered is 17 octets).")

(defun parse-request-line (buffer start end scratch)
  "The method symbol, URI string and protocol keyword of the request line in
BUFFER from START below END.  Refuses a malformed line with 400, a method
over +MAX-METHOD-OCTETS+ with 501 (RFC 9110 9.1: not implemented), another
HTTP version with 505."
  (declare (type octets buffer) (type fixnum start end))
  (let ((method-end (or (octet-position 32 buffer start end) end)))
    (when (or (= method-end start) (= method-end end)
              (not (loop for index of-type fixnum from start below method-end
                         always (token-octet-p (aref buffer index)))))
      (refuse-head 400))
    (when (> (- method-end start) +max-method-octets+)
      (refuse-head 501))
    (let* ((uri-start (1+ method-end))
           (uri-end (or (octet-position 32 buffer uri-start end) end))
           (protocol-start (1+ uri-end)))
      (when (or (= uri-start uri-end) (>= uri-end end)
                (not (loop for index of-type fixnum from uri-start below uri-end
                           always (<= 33 (aref buffer index) 126))))
        (refuse-head 400))
      ;; RFC 9110 9.1: a method is case-sensitive, so "get" is not GET.
      (values (head-symbol buffer start method-end scratch :upcase nil)
              (octets-to-string buffer uri-start uri-end)
              (parse-protocol buffer protocol-start end)))))

(defun add-header (headers name value)
  "HEADERS with NAME: VALUE added.  A repeated name joins its values with
commas, as Hunchentoot (through Chunga) does; two Content-Length headers
must agree, or the head is refused as a smuggling attempt (400), and a
second Host is refused (RFC 9112 3.2)."
  (let ((existing (if (symbol-package name)
                      ;; A keyword: any earlier header of that name has it.
                      (assoc name headers :test #'eq)
                      (assoc (symbol-name name) headers :key #'symbol-name :test #'string=))))
    (cond ((null existing) (cons (cons name value) headers))
          ((eq name :content-length)
           (if (string= (cdr existing) value) headers (refuse-head 400)))
          ((eq name :host) (refuse-head 400))
          (t (setf (cdr existing) (concatenate 'string (cdr existing) "," value))
             headers))))

(defun parse-header-lines (buffer start end scratch &optional previous-host)
  "The headers alist of the header lines in BUFFER from START (just past the
request line) below END (the blank line's LF).  Refuses with 400 a
line that is not NAME: VALUE, a name followed by whitespace before its colon,
a folded line, or a control character in a value.  A Host value spelled as
PREVIOUS-HOST is PREVIOUS-HOST itself."
  (declare (type octets buffer) (type fixnum start end))
  (loop with headers = '()
        for line-start of-type fixnum = start then (1+ lf-position)
        for lf-position = (octet-position +lf+ buffer line-start end)
        while lf-position
        do (let* ((line-end (line-end-before-lf buffer line-start lf-position))
                  (colon (octet-position 58 buffer line-start line-end)))
             (when (or (null colon) (= colon line-start)
                       (not (loop for index of-type fixnum from line-start below colon
                                  always (token-octet-p (aref buffer index)))))
               (refuse-head 400))
             (multiple-value-bind (value-start value-end) (trim-field buffer (1+ colon) line-end)
               (unless (loop for index of-type fixnum from value-start below value-end
                             always (field-octet-p (aref buffer index)))
                 (refuse-head 400))
               (let ((name (head-symbol buffer line-start colon scratch)))
                 (setf headers (add-header headers name
                                           (if (and (eq name :host) previous-host
                                                    (octets-spell-p buffer value-start value-end previous-host))
                                               previous-host
                                               (octets-to-string buffer value-start value-end)))))))
        finally (return (nreverse headers))))

(defun split-codings (transfer-encoding)
  "The transfer codings of a Transfer-Encoding value, trimmed, in order."
  (loop for start = 0 then (1+ comma)
        for comma = (position #\, transfer-encoding :start start)
        collect (string-trim '(#\Space #\Tab) (subseq transfer-encoding start comma))
        while comma))

(defun check-message-framing (headers protocol)
  "Refuse a head whose body length is ambiguous, the request smuggling
vectors of RFC 9112 6: with 400 Content-Length together with
Transfer-Encoding, a Content-Length that is not a decimal number, a
Transfer-Encoding whose last coding is not chunked, or any Transfer-Encoding
in HTTP/1.0 (6.1: its framing is faulty); with 501 codings before chunked,
which this server does not decode (6.1)."
  (let ((content-length (cdr (assoc :content-length headers)))
        (transfer-encoding (cdr (assoc :transfer-encoding headers))))
    (when (and content-length transfer-encoding)
      (refuse-head 400))
    (when (and content-length
               (or (zerop (length content-length))
                   (> (length content-length) 18)
                   (notevery #'digit-char-p content-length)))
      (refuse-head 400))
    (when transfer-encoding
      (let ((codings (split-codings transfer-encoding)))
        (cond ((or (eq protocol :http/1.0)
                   (not (string-equal "chunked" (car (last codings)))))
               (refuse-head 400))
              ((rest codings) (refuse-head 501)))))))

(defun check-host (headers uri protocol &optional valid-host)
  "HEADERS with the Host the request names: RFC 9112 3.2 refuses with 400 an
HTTP/1.1 request without Host (a second Host is refused as it is read) or
an invalid one; a target in absolute form names the host instead of the
Host header (3.2.2).  A Host value that is VALID-HOST itself, a string
found valid before, is not checked again."
  (let ((host (assoc :host headers))
        (authority (absolute-form-authority uri)))
    (cond ((and (null host) (null authority) (eq protocol :http/1.1)) (refuse-head 400))
          ((and host (not (eq (cdr host) valid-host)) (not (valid-authority-p (cdr host))))
           (refuse-head 400))
          ((null authority) headers)
          ((not (valid-authority-p authority)) (refuse-head 400))
          (host (setf (cdr host) authority) headers)
          (t (append headers (list (cons :host authority)))))))

(defstruct (request-head (:constructor make-request-head ()))
  "A parsed request head: what Hunchentoot's GET-REQUEST-DATA returns.  Each
worker fills one from request to request (PARSE-REQUEST-HEAD), so that a
request conses no head of its own; a head kept past its request's turn, as
an arriving body keeps it, is a copy."
  ;; The headers alist, names as PARSE-HEADER-LINES makes them.
  (headers '() :type list)
  ;; The method's keyword, or an uninterned symbol for a method no code names.
  (method nil :type symbol)
  (uri "" :type string)
  ;; :HTTP/1.1 or :HTTP/1.0.
  (protocol nil :type symbol)
  ;; The Host value of the last request parsed into this head, or NIL:
  ;; the next request naming the same host gets this string again rather
  ;; than a copy, as a client names one host at every request (80 bytes a
  ;; request, bench/profiles/2026-11-28-per-core.txt), and it is not
  ;; checked again, as it was found valid.  Header values are only ever
  ;; read, by Hunchentoot as by handlers.
  (host nil :type (or null simple-string)))

(defmethod print-object ((head request-head) stream)
  ;; Backtraces and logs print it: its method and header count tell which
  ;; request it is without repeating the client's bytes in every frame.
  (print-unreadable-object (head stream :type t :identity t)
    (format stream "~A, ~D headers" (request-head-method head) (length (request-head-headers head)))))

(defun parse-request-head (buffer request-start request-line-end head-end &optional scratch head)
  "Parse the complete head that SCAN-REQUEST-HEAD found into HEAD, a
REQUEST-HEAD, or a new one when HEAD is NIL, spelling names in SCRATCH
(see NAME-SCRATCH); the head.  Signals REQUEST-HEAD-REFUSED with 400 for a
malformed head, an ambiguous body length or a missing or invalid Host, 501
for a transfer coding other than chunked or an over-long method, 505 for
another HTTP version.  An invalid Range header is left out."
  (declare (type octets buffer) (type fixnum request-start request-line-end head-end))
  (multiple-value-bind (method uri protocol)
      (parse-request-line buffer request-start (line-end-before-lf buffer request-start request-line-end) scratch)
    (let* ((blank-line-start (if (= (aref buffer (- head-end 2)) +cr+) (- head-end 2) (1- head-end)))
           (previous-host (and head (request-head-host head)))
           (headers (parse-header-lines buffer (1+ request-line-end) blank-line-start scratch previous-host))
           (head (or head (make-request-head))))
      (check-message-framing headers protocol)
      (setf (request-head-headers head) (without-invalid-range (check-host headers uri protocol previous-host))
            (request-head-method head) method
            (request-head-uri head) uri
            (request-head-protocol head) protocol
            (request-head-host head) (cdr (assoc :host headers)))
      head)))

(defun head-refused-status (buffer request-start request-line-end head-end)
  "The status the complete head in BUFFER is refused with, or NIL when it
is accepted."
  (handler-case (progn (parse-request-head buffer request-start request-line-end head-end) nil)
    (request-head-refused (condition) (refused-status condition))))

;;; What the head says of its body.

(defun request-has-body-p (headers)
  (let ((content-length (cdr (assoc :content-length headers))))
    (or (assoc :transfer-encoding headers)
        (and content-length (string/= content-length "0")))))

(defun body-over-limit-p (headers max-body-bytes)
  "True when HEADERS declare a Content-Length over MAX-BODY-BYTES (NIL: no
limit).  The head parser has made sure the value is digits."
  (let ((content-length (cdr (assoc :content-length headers))))
    (and max-body-bytes content-length
         (> (parse-integer content-length) max-body-bytes))))

(defun expects-continue-p (head)
  "True when the request of HEAD waits for 100 Continue before its body:
Expect: 100-continue, ignored in HTTP/1.0 (RFC 9110 10.1.1), which has no
1xx replies."
  (let ((expect (cdr (assoc :expect (request-head-headers head)))))
    (and expect
         (eq (request-head-protocol head) :http/1.1)
         (search "100-continue" expect :test #'char-equal))))
