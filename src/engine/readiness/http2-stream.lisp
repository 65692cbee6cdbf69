;;;; An HTTP/2 stream's request as it arrives: its pseudo-headers, headers
;;;; and body, each checked against the acceptor's limits as they come (the
;;;; body's pieces taken from the memory budget), then joined into an
;;;; HTTP/1.1 head and its body, which the request cycle's own parser makes
;;;; the request of, so that both protocols give handlers the same one.
;;;; Plain Lisp: nghttp2-session.lisp gives it what libnghttp2 reports.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +http2-header-overhead+ 32
  "Octets a header counts beyond its name and value in a header list's
size (RFC 9113 6.5.2, SETTINGS_MAX_HEADER_LIST_SIZE).")

(defstruct (http2-stream (:constructor make-http2-stream (id)))
  "A request stream of an HTTP/2 connection, from its HEADERS to its close."
  (id 0 :type fixnum :read-only t)
  ;; Pseudo-headers, as strings, NIL until named.
  (method nil)
  (path nil)
  (authority nil)
  ;; The other headers, (name . value) octets, newest first, and the
  ;; octets of their lines; the Cookie headers' values, newest first,
  ;; joined into one line at the end.
  (headers '())
  (header-octets 0 :type fixnum)
  (cookies '())
  (host-p nil)
  ;; Octets the header list counts so far, as SETTINGS_MAX_HEADER_LIST_SIZE
  ;; counts them, decoded by the library whether kept or not.
  (header-list-size 0 :type fixnum)
  ;; True once its header block is whole: later HEADERS are trailers.
  (headers-done-p nil)
  ;; The body's pieces, newest first, and their octets, taken from the
  ;; memory budget as they came.
  (body-pieces '())
  (body-length 0 :type fixnum)
  ;; The status answered instead of a handler (400, 413, 431), or NIL.
  (refusal nil)
  ;; :OPEN while the request arrives, :QUEUED once it is whole and waits
  ;; for or has a worker, :ANSWERED once its reply's HEADERS are submitted,
  ;; :CLOSED.
  (state :open)
  ;; The reply's body as it is made: octet vectors not taken by the
  ;; library yet, oldest first, the last cons, and where the library's
  ;; next read starts in the first.  Each is charged to the memory budget
  ;; from its making until the library has taken it (REPLY-QUEUED octets).
  (reply-pieces '())
  (reply-pieces-tail '())
  (reply-position 0 :type fixnum)
  (reply-queued 0 :type fixnum)
  ;; The octets of the reply's body made so far, taken or not.
  (reply-made 0 :type fixnum)
  ;; True once the reply's maker has ended its body: the library's read of
  ;; the last octets ends the stream.
  (reply-ended-p nil)
  ;; True while the library waits for more of the body (its read found
  ;; none): the next octets or the end resume it.
  (reply-deferred-p nil)
  ;; A function of no argument called once as the stream closes, with the
  ;; session's lock held (it must neither wait nor call the session): the
  ;; reply its handler deferred learns that its client is gone.  Or NIL.
  (on-close nil))

(defun add-request-header (stream name value)
  "Add the header NAME: VALUE (octets) to STREAM's head."
  (push (cons name value) (http2-stream-headers stream))
  (incf (http2-stream-header-octets stream) (+ (length name) (length value) 4)))

(defun note-http2-header (stream name value max-body-bytes)
  "One header of STREAM's request, NAME and VALUE octets as the library
checked them (RFC 9113 8.2: lower-case names, no CR, LF or NUL), within
the header list's limit (its size is counted by the session as the
library decodes it, HEADER-LIST-SIZE); a Content-Length past
MAX-BODY-BYTES (NIL: none) refuses it 413."
  (cond ((http2-stream-refusal stream))
        ((and (plusp (length name)) (= (aref name 0) #.(char-code #\:)))
         (let ((text (latin-1-text value 0 (length value))))
           (cond ((octets-equal-string-p name ":method") (setf (http2-stream-method stream) text))
                 ((octets-equal-string-p name ":path") (setf (http2-stream-path stream) text))
                 ((octets-equal-string-p name ":authority") (setf (http2-stream-authority stream) text)))))
        ((octets-equal-string-p name "cookie")
         (push value (http2-stream-cookies stream)))
        ;; Its length is the body's, counted as it comes.
        ((octets-equal-string-p name "content-length")
         (let ((length (ignore-errors (parse-integer (latin-1-text value 0 (length value))))))
           (when (and length max-body-bytes (> length max-body-bytes))
             (setf (http2-stream-refusal stream) 413))))
        (t (when (octets-equal-string-p name "host")
             (setf (http2-stream-host-p stream) t))
           (add-request-header stream name value))))

(defun octets-equal-string-p (octets string)
  (declare (type octets octets) (type simple-string string))
  (and (= (length octets) (length string))
       (loop for octet across octets
             for char across string
             always (= octet (char-code char)))))

(defun add-http2-body-piece (stream piece budget max-body-bytes)
  "Keep PIECE, octets of STREAM's body, taken from the memory BUDGET; past
MAX-BODY-BYTES (NIL: none) or the budget, STREAM is refused (413, 503) and
its body dropped."
  (let ((length (length piece)))
    (cond ((http2-stream-refusal stream))
          ((and max-body-bytes (> (+ (http2-stream-body-length stream) length) max-body-bytes))
           (drop-http2-stream-body stream budget)
           (setf (http2-stream-refusal stream) 413))
          ((not (reserve-memory budget length :input-p t))
           (drop-http2-stream-body stream budget)
           (setf (http2-stream-refusal stream) 503))
          (t (push piece (http2-stream-body-pieces stream))
             (incf (http2-stream-body-length stream) length)))))

(defun drop-http2-stream-body (stream budget)
  "Give STREAM's body back to the memory BUDGET."
  (release-memory budget (http2-stream-body-length stream))
  (setf (http2-stream-body-pieces stream) '()
        (http2-stream-body-length stream) 0))

(defun http2-stream-request-octets (stream body-pieces body-length)
  "STREAM's request as an HTTP/1.1 head and its body -- BODY-PIECES, newest
first, BODY-LENGTH octets, taken from it (TAKE-HTTP2-STREAM-BODY) -- in one
vector; second and third values, where the head's request line ends (its
LF) and where the head ends."
  (let* ((request-line (format nil "~A ~A HTTP/1.1~C~C" (or (http2-stream-method stream) "GET")
                               (or (http2-stream-path stream) "") #\Return #\Linefeed))
         (extra (with-output-to-string (out)
                  (when (and (http2-stream-authority stream) (not (http2-stream-host-p stream)))
                    (format out "host: ~A~C~C" (http2-stream-authority stream) #\Return #\Linefeed))
                  (when (http2-stream-cookies stream)
                    (format out "cookie: ~{~A~^; ~}~C~C"
                            (mapcar (lambda (value) (latin-1-text value 0 (length value)))
                                    (reverse (http2-stream-cookies stream)))
                            #\Return #\Linefeed))
                  (when (or (plusp body-length)
                            (member (http2-stream-method stream) '("POST" "PUT" "PATCH") :test #'equal))
                    (format out "content-length: ~D~C~C" body-length #\Return #\Linefeed))))
         (head-end (+ (length request-line) (http2-stream-header-octets stream) (length extra) 2))
         (octets (make-array (+ head-end body-length) :element-type '(unsigned-byte 8)))
         (position 0))
    (declare (type fixnum position))
    (flet ((add-text (text)
             (loop for char across text
                   do (setf (aref octets position) (char-code char))
                      (incf position)))
           (add-octets (vector)
             (replace octets vector :start1 position)
             (incf position (length vector))))
      (add-text request-line)
      (loop for (name . value) in (reverse (http2-stream-headers stream))
            do (add-octets name)
               (add-octets #.(coerce (map 'vector #'char-code ": ") 'octets))
               (add-octets value)
               (add-octets #.(coerce #(13 10) 'octets)))
      (add-text extra)
      (add-octets #.(coerce #(13 10) 'octets))
      (dolist (piece (reverse body-pieces))
        (add-octets piece)))
    (values octets (1- (length request-line)) head-end)))

(defun header-fields-text (fields)
  "The names and values of FIELDS (an alist of strings) one after the
other, as octets (their characters' codes)."
  (let ((text (make-array (loop for (name . value) in fields sum (+ (length name) (length value)))
                          :element-type '(unsigned-byte 8)))
        (position 0))
    (declare (type fixnum position))
    (loop for (name . value) in fields
          do (loop for string in (list name value)
                   do (loop for char across string
                            do (setf (aref text position) (logand #xff (char-code char)))
                               (incf position))))
    text))

