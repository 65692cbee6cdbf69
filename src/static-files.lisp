;;;; Static files, sent by the kernel.  SERVE-STATIC-FILE answers a request
;;;; for one file as RFC 9110 asks -- validators (ETag, Last-Modified,
;;;; If-None-Match, If-Modified-Since compared as dates, If-Range), byte
;;;; ranges (single, suffix, open, several as multipart/byteranges, 416 when
;;;; none can be satisfied), a precompressed .zst, .br or .gz sibling for a
;;;; client that accepts its coding, else the file coded as it is read when
;;;; the acceptor codes replies (reply-coding.lisp), HEAD -- and, under a
;;;; parallel acceptor on a plain
;;;; connection, hands the head as octets and the body as ranges of the
;;;; descriptor it opened and looked at once to the engine, which sends them
;;;; with sendfile(2), no copy through Lisp, and what a slow client does not
;;;; take at once when it reads, without a worker waiting.  Elsewhere (TLS,
;;;; Hunchentoot's own acceptors) the same reply is copied through the
;;;; connection's stream.  CREATE-STATIC-FOLDER-DISPATCHER-AND-HANDLER is
;;;; HUNCHENTOOT:CREATE-FOLDER-DISPATCHER-AND-HANDLER served this way, with
;;;; the request path kept inside its folder.  The headers' wire format is
;;;; engine/http/conditional-headers.lisp's and range-header.lisp's; the
;;;; acceptor's document root, document-root.lisp's.

(in-package #:hunchentoot-recycling-taskmaster)

;;; The file to send.

(defstruct (file-to-send (:constructor %make-file-to-send (fd size modified content-encoding)))
  "A regular file opened for one reply."
  (fd -1 :type fixnum :read-only t)
  (size 0 :type (integer 0) :read-only t)
  ;; Its modification time, a universal time.
  (modified 0 :type integer :read-only t)
  ;; "gzip", "br" or "zstd" when this is a precompressed sibling, else NIL.
  (content-encoding nil :read-only t))

(defun open-file-to-send (namestring &optional content-encoding)
  (multiple-value-bind (fd size modified) (open-regular-file namestring)
    (and fd (%make-file-to-send fd size modified content-encoding))))

(defun entity-tag (file)
  "FILE's strong entity tag, from its size, modification time and coding."
  (format nil "\"~(~x-~x~)~@[-~A~]\"" (file-to-send-size file) (file-to-send-modified file)
          (file-to-send-content-encoding file)))

(defparameter *sibling-extensions* '((:zstd . ".zst") (:br . ".br") (:gzip . ".gz"))
  "Each coding's precompressed sibling: its extension, in the order they
are preferred unless the acceptor's :COMPRESSION says otherwise.")

(defconstant +coded-static-file-bytes+ (* 1024 1024)
  "The largest static file coded as it is read; a larger one is sent as it
is, unless it has a precompressed sibling.")

(defun preferred-codings ()
  "The codings a static file may be sent in, preferred first: the parallel
acceptor's :COMPRESSION, else every sibling's."
  (let ((levels (and (typep hunchentoot:*acceptor* 'parallel-acceptor)
                     (acceptor-compression hunchentoot:*acceptor*))))
    (if levels (mapcar #'car levels) (mapcar #'car *sibling-extensions*))))

(defun open-precompressed-sibling (namestring)
  "The file to send for NAMESTRING's precompressed sibling in the first
coding of PREFERRED-CODINGS the client accepts that has one, or NIL;
second value, true when such a sibling is there for any of them (the reply
then varies with Accept-Encoding)."
  (let ((accept-encoding (hunchentoot:header-in* :accept-encoding))
        (any nil))
    (dolist (coding (preferred-codings) (values nil any))
      (let ((sibling (concatenate 'string namestring (cdr (assoc coding *sibling-extensions*)))))
        (if (accepted-coding accept-encoding (list coding))
            (let ((file (open-file-to-send sibling (string-downcase (symbol-name coding)))))
              (when file
                (return (values file t))))
            (when (and (not any) (file-signature sibling))
              (setf any t)))))))

;;; Preconditions (RFC 9110 13.2.2, for GET and HEAD).

(defun not-modified-p (file tag)
  "True when the request's If-None-Match, else its If-Modified-Since, says
the client's copy of FILE is current."
  (let ((if-none-match (hunchentoot:header-in* :if-none-match))
        (if-modified-since (hunchentoot:header-in* :if-modified-since)))
    (cond (if-none-match (entity-tag-listed-p tag if-none-match))
          (if-modified-since
           (let ((date (parse-http-date if-modified-since)))
             (and date (<= (file-to-send-modified file) date)))))))

(defun range-applies-p (file tag)
  "False when an If-Range header names another version of FILE than the one
there is: an entity tag compared strongly, or a date that is not exactly
its Last-Modified."
  (let ((if-range (hunchentoot:header-in* :if-range)))
    (or (null if-range)
        (if (find #\" if-range)
            (string= (string-trim " " if-range) tag)
            (eql (parse-http-date if-range) (file-to-send-modified file))))))

;;; Sending.

(defun send-file-pieces (request file return-code content-length pieces)
  "Send RETURN-CODE's head for a body of CONTENT-LENGTH octets, then PIECES
of FILE: under a parallel acceptor by SEND-REPLY-PIECES (sendfile(2) on a
plain connection), under Hunchentoot's own after HUNCHENTOOT:SEND-HEADERS.
True when the body went whole or will."
  (if (typep hunchentoot:*acceptor* 'parallel-acceptor)
      (send-reply-pieces request return-code content-length pieces (file-to-send-fd file))
      (progn (setf (hunchentoot:return-code*) return-code
                   (hunchentoot:content-length*) content-length)
             (write-reply-body pieces (file-to-send-fd file) (hunchentoot:send-headers)))))

(defun latin-1-octets (control &rest arguments)
  (flex:string-to-octets (apply #'format nil control arguments) :external-format :latin-1))

(defun multipart-pieces (ranges size content-type boundary)
  "The pieces of a multipart/byteranges body of RANGES of a file of SIZE
octets: each part's head, then its octets of the file; then the closing
boundary."
  (flet ((octets-piece (octets) (make-octets-piece octets 0 (length octets))))
    (append (loop for (start . end) in ranges
                  collect (octets-piece (latin-1-octets "~C~C--~A~C~CContent-Type: ~A~C~CContent-Range: bytes ~D-~D/~D~C~C~C~C"
                                                        #\Return #\Linefeed boundary #\Return #\Linefeed
                                                        content-type #\Return #\Linefeed
                                                        start (1- end) size #\Return #\Linefeed #\Return #\Linefeed))
                  collect (make-file-piece start end))
            (list (octets-piece (latin-1-octets "~C~C--~A--~C~C" #\Return #\Linefeed boundary #\Return #\Linefeed))))))

(defun send-file-reply (request file content-type tag)
  "Answer REQUEST with FILE: 304, 416, 206 or 200 as its preconditions and
Range header say.  The connection is closed after a body that could not
be sent whole."
  (let ((size (file-to-send-size file))
        (head-p (eq (hunchentoot:request-method request) :head)))
    (when (not-modified-p file tag)
      (end-request-with hunchentoot:+http-not-modified+))
    (let* ((range-header (hunchentoot:header-in* :range))
           (ranges (and range-header
                        (eq (hunchentoot:request-method request) :get)
                        (range-applies-p file tag)
                        (parse-byte-ranges range-header size)))
           (sent-whole-p
             (cond ((eq ranges :unsatisfiable)
                    (setf (hunchentoot:header-out :content-range) (format nil "bytes */~D" size))
                    (end-request-with hunchentoot:+http-requested-range-not-satisfiable+))
                   ((null ranges)
                    (send-file-pieces request file hunchentoot:+http-ok+ size
                                      (unless head-p (list (make-file-piece 0 size)))))
                   ((null (rest ranges))
                    (destructuring-bind ((start . end)) ranges
                      (setf (hunchentoot:header-out :content-range)
                            (format nil "bytes ~D-~D/~D" start (1- end) size))
                      (send-file-pieces request file hunchentoot:+http-partial-content+ (- end start)
                                        (list (make-file-piece start end)))))
                   (t
                    (let* ((boundary (format nil "~36R~36R" (random (expt 2 62)) (get-universal-time)))
                           (pieces (multipart-pieces ranges size content-type boundary)))
                      (setf (hunchentoot:content-type*) (format nil "multipart/byteranges; boundary=~A" boundary))
                      (send-file-pieces request file hunchentoot:+http-partial-content+
                                        (loop for piece in pieces sum (- (piece-end piece) (piece-start piece)))
                                        pieces))))))
      (unless sent-whole-p
        ;; The client has been promised octets it did not get: the next
        ;; reply on this connection would be read as the rest of them.
        (setf (finish-processing-connection-p) t))
      nil)))

(defun end-request-with (status)
  "End the handler with STATUS, answered with the acceptor's status message."
  (setf (hunchentoot:return-code*) status)
  (hunchentoot:abort-request-handler))

(defun file-octets (file)
  "The octets of FILE, read from its descriptor, as many as it holds now."
  (let ((octets (make-array (file-to-send-size file) :element-type '(unsigned-byte 8))))
    (loop with position = 0
          for count = (and (< position (length octets))
                           (read-file-octets (file-to-send-fd file) octets position position))
          while (and count (plusp count))
          do (incf position count)
          finally (return (if (= position (length octets)) octets (subseq octets 0 position))))))

(defun static-file-coding (file content-type)
  "The (CODING . LEVEL) FILE, not a precompressed sibling, is coded with as
it is read, or NIL; second value, true when it would be coded for a client
that accepts a coding."
  (when (and *serving*
             (<= (file-to-send-size file) +coded-static-file-bytes+)
             (codable-reply-p hunchentoot:*acceptor* hunchentoot:+http-ok+ content-type
                              (file-to-send-size file)))
    (values (reply-coding hunchentoot:*request*) t)))

(defun send-coded-file-reply (request file coding)
  "Answer REQUEST with FILE coded with CODING, a (CODING . LEVEL), as it is
read: 304 when the client's copy is this coding's, else 200 with the whole
file (a Range is not applied: the coded octets are not the file's)."
  (mark-coded-reply (car coding))
  (when (not-modified-p file (hunchentoot:header-out :etag))
    (end-request-with hunchentoot:+http-not-modified+))
  (let ((coded (coded-octets (car coding) (cdr coding) (file-octets file))))
    (unless (send-reply-pieces request hunchentoot:+http-ok+ (length coded)
                               (unless (eq (hunchentoot:request-method request) :head) coded)
                               nil t)
      (setf (finish-processing-connection-p) t))
    nil))

(defun serve-static-file (pathname &key content-type cache-control (precompressed t))
  "A handler's answer with the file PATHNAME, as HUNCHENTOOT:HANDLE-STATIC-FILE
answers it and with what RFC 9110 adds: Last-Modified, a strong ETag (from
the size and modification time), Accept-Ranges, If-None-Match (a list, or
*) and If-Modified-Since compared as dates (304), If-Range, Range (one
range, suffix and open ranges: 206 with Content-Range; several:
multipart/byteranges; none satisfiable: 416 with Content-Range bytes */SIZE),
HEAD.  CONTENT-TYPE defaults to HUNCHENTOOT:MIME-TYPE of PATHNAME's name,
and a text type without a charset gets the reply's, as Hunchentoot sends it;
CACHE-CONTROL, when given, is sent as the Cache-Control header.  When
PRECOMPRESSED is true and PATHNAME.zst, .br or .gz is a regular file, a
client that accepts its coding gets it with Content-Encoding (the
acceptor's :COMPRESSION says which first, else zstd, br, gzip).  Else, an
acceptor that codes replies codes a file of its COMPRESSION-TYPES up to 1
MiB as it reads it, whole (no ranges), with the coding's own ETag.  Either
way the reply says Vary: Accept-Encoding.  A name that is not a regular
file is answered 404.  The file is opened and looked at once; under a
parallel acceptor on a plain connection a body not coded on the way goes
by sendfile(2).  Returns NIL once the reply is sent, as a handler that
sent it itself; unspecified: when the octets leave the kernel."
  (let ((namestring (if (pathnamep pathname) (native-path pathname) pathname)))
    (multiple-value-bind (sibling sibling-there-p)
        (if precompressed (open-precompressed-sibling namestring) (values nil nil))
      (let ((file (or sibling (open-file-to-send namestring))))
        (unless file
          (end-request-with hunchentoot:+http-not-found+))
        (unwind-protect
             (let ((content-type (let ((type (or content-type (hunchentoot:mime-type (file-namestring namestring)))))
                                   (if type
                                       (content-type-with-charset type (hunchentoot:reply-external-format*))
                                       "application/octet-stream")))
                   (tag (entity-tag file)))
               (setf (hunchentoot:content-type*) content-type
                     (hunchentoot:header-out :last-modified) (hunchentoot:rfc-1123-date (file-to-send-modified file))
                     (hunchentoot:header-out :etag) tag)
               (when cache-control
                 (setf (hunchentoot:header-out :cache-control) cache-control))
               (multiple-value-bind (coding codable-p) (and (null sibling) (static-file-coding file content-type))
                 (when (or sibling-there-p codable-p)
                   (add-vary-accept-encoding))
                 (cond (coding (send-coded-file-reply hunchentoot:*request* file coding))
                       (t (setf (hunchentoot:header-out :accept-ranges) "bytes")
                          (when (file-to-send-content-encoding file)
                            (setf (hunchentoot:header-out :content-encoding) (file-to-send-content-encoding file)))
                          (send-file-reply hunchentoot:*request* file content-type tag)))))
          (close-fd (file-to-send-fd file)))))))

;;; The folder dispatcher.

(defun folder-relative-path (script-name uri-prefix)
  "The path below URI-PREFIX that SCRIPT-NAME names, as the folder's own
relative native path; :FORBIDDEN when it climbs (a .. segment, as
Hunchentoot answers 403); NIL when it cannot name a file there (an empty
or . segment, a directory, a NUL or a backslash)."
  (let ((relative (subseq script-name (length uri-prefix))))
    (cond ((or (zerop (length relative))
               (find (code-char 0) relative)
               (find #\\ relative))
           nil)
          (t
           (let ((segments (cl-ppcre:split "/" relative :limit most-positive-fixnum)))
             (cond ((member ".." segments :test #'string=) :forbidden)
                   ((some (lambda (segment) (or (string= segment "") (string= segment "."))) segments)
                    nil)
                   (t relative)))))))

(defun create-static-folder-dispatcher-and-handler (uri-prefix base-path &optional content-type cache-control
                                                                                  follow-outside-links-p)
  "HUNCHENTOOT:CREATE-FOLDER-DISPATCHER-AND-HANDLER, the file sent by
SERVE-STATIC-FILE: a dispatch function for HUNCHENTOOT:*DISPATCH-TABLE*
that answers a request whose script name starts with URI-PREFIX (a string
ending with a slash) with the file relative to BASE-PATH (an existing
directory) that the rest of it names.  CONTENT-TYPE, when given, is every
file's type; CACHE-CONTROL the Cache-Control header of every reply.  A path
that climbs out of the folder (..) is answered 403; one with an empty or .
segment, a NUL or a backslash, or naming a directory, 404.  A symbolic
link that leads outside BASE-PATH is answered 404 unless
FOLLOW-OUTSIDE-LINKS-P."
  (unless (and (stringp uri-prefix)
               (plusp (length uri-prefix))
               (char= (char uri-prefix (1- (length uri-prefix))) #\/))
    (error 'invalid-static-folder :initarg 'uri-prefix :value uri-prefix
                                  :reason "must be a string ending with a slash"))
  (let ((folder (let ((probed (ignore-errors (probe-file base-path))))
                  (and probed (real-path (native-path probed))))))
    (unless (and folder (directory-path-p folder))
      (error 'invalid-static-folder :initarg 'base-path :value base-path
                                    :reason "names no existing directory"))
    (let ((folder-prefix (if (char= (char folder (1- (length folder))) #\/) folder (concatenate 'string folder "/"))))
      (hunchentoot:create-prefix-dispatcher
       uri-prefix
       (lambda ()
         (let ((relative (folder-relative-path (hunchentoot:script-name*) uri-prefix)))
           (case relative
             ((nil) (end-request-with hunchentoot:+http-not-found+))
             (:forbidden (end-request-with hunchentoot:+http-forbidden+)))
           (let* ((namestring (concatenate 'string folder-prefix relative))
                  (resolved (real-path namestring)))
             (unless (and resolved
                          (or follow-outside-links-p
                              (and (> (length resolved) (length folder-prefix))
                                   (string= folder-prefix resolved :end2 (length folder-prefix)))))
               (end-request-with hunchentoot:+http-not-found+))
             (serve-static-file namestring :content-type content-type :cache-control cache-control))))))))
